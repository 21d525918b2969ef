"""FFN modules that take the place of a model's MLP and compute it from a flash store.

FlashFFN ('LLM in a flash'): per token, the active neuron ids (a predictor, a fixed set, or every neuron) ->
NeuronCache.step (evict what left the window, read the missing bundles) -> sparse_ffn over exactly this token's
rows of the cache (+ the output projection's bias). A forward of T tokens (a prompt) groups its tokens so that
each group's union of active sets fits the cache: one cache step (one batch of coalesced reads) per group, then
one sparse_ffn call per token with that token's own rows, so a prompt costs a few large reads, not T steps, and
every token still follows the active-neuron rule exactly (flashllm_ext.predictor.rule). A token whose own set exceeds
the cache is computed in capacity-sized parts. With a hot set (`hot_ids`: the engine's hot-cold layout) those neurons
are pinned in the cache, read once and never evicted; a token reads only its cold misses, and only its cold neurons
count against the rows the hot set leaves.

StreamingFFN (the paper's baselines): the first `resident_rows` bundles of the layer are read once and kept, the
others are re-read from flash on every forward into a staging buffer that all layers share; every neuron is
computed. resident_rows = 0 is "naive" (everything re-read per token), a budget-filled part is "hybrid".

Both accumulate their costs in an FFNStats, so an engine can report I/O, memory-management, predictor and compute
time per token.

On a GPU (device="cuda": the cache rows, resident bundles and staging on the device, flashllm_ext/flash/transfer.py) the
input, the float32 accumulator and the output stay on the input's device; only the active set crosses to the host,
where the cache plans. Per-token work is not capturable in a CUDA graph: which neurons are read, and so how many rows
each kernel covers, is decided on the host from the predictor's answer of this very token (one device-to-host copy of
the mask per layer), and the reads are host I/O. A part boundary of the breakdown synchronises the compute stream on
CUDA (the transfer's clock), so each part is device time rather than launch time.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass, fields

import torch
from torch import nn

from flashllm_ext.ops import config_activation
from flashllm_ext.flash.cache import NeuronCache, PendingStep, StepStats, input_bias_role, layer_input_bias
from flashllm_ext.io.disk import load_disk_profile
from flashllm_ext.flash.reader import FlashReader
from flashllm_ext.flash.store import FlashStore
from flashllm_ext.flash.transfer import Transfer


PREFILL_PATHS = ("auto", "union", "sequential")
# What a decode forward does with the set FlashFFN.prefetch chose ahead: "ahead" computes it (DejaVu); "prefetch"
# only read it early, and the forward computes the set its predictor chooses from its own input (flash's results).
LOOKAHEAD_MODES = ("ahead", "prefetch")

SPARSE_FFN = torch.ops.flashllm.sparse_ffn.default  # the ops (flashllm_ext/ops/ffn.py), for bundle_ffn
QUANTIZED_SPARSE_FFN = torch.ops.flashllm.quantized_sparse_ffn.default

# What a predictor returns for x [T, d]: a bool mask [T, n] (per-token active sets), or one set shared by every
# token as int64 ids [k] or a bool mask [n].
Predictor = Callable[[torch.Tensor], torch.Tensor]


def store_activation(store: FlashStore) -> str:
    """The sparse_ffn activation of the store's model (ops.config_activation); ValueError naming the store."""
    try:
        return config_activation(store.config)
    except ValueError as e:
        raise ValueError(f"{store.path}: {e}") from None


def output_bias(store: FlashStore, layer: int) -> torch.Tensor | None:
    """The down projection's bias (OPT's fc2.bias) in float32, added to the float32 accumulator; None if none."""
    bias = store.layer_bias(layer, "down_bias")
    return None if bias is None else bias.float()


def active_ids_of(selection: torch.Tensor, n_neurons: int) -> torch.Tensor:
    """int64 ids from a predictor's answer: ids [k] as they are, a bool mask [n] or [T, n] as its active ids
    (a neuron active for any token)."""
    if selection.dtype == torch.bool:
        if selection.shape[-1] != n_neurons or selection.dim() not in (1, 2):
            raise ValueError(
                f"a bool mask must have shape [n] or [T, n] with n={n_neurons}, got {tuple(selection.shape)}"
            )
        mask = selection if selection.dim() == 1 else selection.any(dim=0)
        return mask.nonzero().flatten()
    if selection.dim() != 1 or selection.dtype not in (torch.int64, torch.int32):
        raise ValueError(
            f"active ids must be a 1-D integer tensor, got {selection.dtype} of shape {tuple(selection.shape)}"
        )
    return selection.to(torch.int64)


@dataclass
class FFNStats:
    """Costs accumulated by the FFN modules of a model (reset with `reset`)."""

    tokens: int = 0  # tokens the FFN ran on (per layer: a model's total is tokens / layers)
    steps: int = 0  # NeuronCache steps (flash) or streamed reads (naive/hybrid)
    needed: int = 0  # neurons the steps needed (a cache hit when already cached)
    inserted: int = 0  # bundles read from flash for the sets the FFN computed
    prefetched: int = 0  # bundles read ahead (lookahead="prefetch") before the FFN chose its own set
    guessed: int = 0  # neurons needed that a look-ahead had guessed (an MoE layer's experts read ahead)
    bytes_read: int = 0
    bytes_requested: int = 0  # the bundles' own bytes (compressed for Endor): bytes_read less padding and gaps
    n_reads: int = 0  # read requests issued (after coalescing)
    io_s: float = 0.0  # waiting for reads (exposed)
    hidden_io_s: float = 0.0  # read time that overlapped compute
    decompress_s: float = 0.0  # Endor stores: the part of the read time (exposed or hidden) spent decompressing
    mem_s: float = 0.0  # cache bookkeeping: planning, swap-delete, pointer/bias updates
    predictor_s: float = 0.0
    compute_s: float = 0.0  # sparse_ffn and the output bias

    def add_step(self, step: StepStats, needed: int, prefetch: bool = False) -> None:
        """Count a cache step that needed `needed` neurons (a prefetch: none, its reads counted as prefetched)."""
        self.steps += 1
        self.needed += needed
        if prefetch:
            self.prefetched += step.inserted
        else:
            self.inserted += step.inserted
        self.bytes_read += step.bytes_read
        self.bytes_requested += step.bytes_requested
        self.n_reads += step.n_reads
        self.io_s += step.io_s
        self.hidden_io_s += step.hidden_io_s
        self.decompress_s += step.decompress_s
        self.mem_s += step.mem_s

    def reset(self) -> None:
        for f in fields(self):
            setattr(self, f.name, f.default)

    @property
    def hit_rate(self) -> float:
        """Fraction of needed neurons that were already in DRAM (prefetched ones included)."""
        return 1.0 - self.inserted / self.needed if self.needed else 1.0


def bundle_ffn(
    store: FlashStore,
    x: torch.Tensor,
    matrix: torch.Tensor,
    *,
    num_used: int,
    activation: str,
    bias: torch.Tensor | None = None,
    index: torch.Tensor | None = None,
    threshold: float = 0.0,
) -> torch.Tensor:
    """The FFN of x [T, d] over bundle rows of `store` as it holds them (matrix [C, row_width] of its row_dtype):
    ops.sparse_ffn over float bundles, ops.quantized_sparse_ffn over a quantized store's. Arguments as theirs."""
    # the ops themselves, not their keyword wrappers: a decode token calls this once a layer, where each Python call
    # costs microseconds
    if store.bundle_format is None:
        return SPARSE_FFN(x, matrix, num_used, bias, activation, store.glu, index, threshold)
    fmt = store.bundle_format.name
    return QUANTIZED_SPARSE_FFN(x, matrix, num_used, bias, activation, store.glu, fmt, index, threshold)


def kernel_input_dtype(store: FlashStore, layer: int) -> torch.dtype:
    """The dtype x goes into bundle_ffn in for `layer`: the store's over float bundles, and over quantized ones whose
    rows carry an input bias (the kernels take it in x's dtype); float32 over quantized rows without one, as the
    decoder's activations come (the kernels round x per block to int8 codes from any float dtype: a cast would cost
    a decode token a tensor op a layer, and round twice)."""
    input_bias = input_bias_role(store) in store.ffn_roles[layer]
    return store.dtype if store.bundle_format is None or input_bias else torch.float32


def as_kernel_input(flat: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """flat [T, d] contiguous in `dtype` (kernel_input_dtype's), flat itself where it is already."""
    return flat if flat.dtype is dtype and flat.is_contiguous() else flat.to(dtype).contiguous()


def as_float32(y: torch.Tensor) -> torch.Tensor:
    """y as float32 (y itself if it is: a no-op cast still costs a decode token microseconds a layer)."""
    return y if y.dtype is torch.float32 else y.float()


def as_ffn_output(out: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """An FFN's float32 result out [T, d] in the dtype and shape of its input x [..., d] (out itself where they
    are its own)."""
    out = out if out.dtype is x.dtype else out.to(x.dtype)
    return out if x.dim() == 2 else out.reshape(x.shape)


def check_ffn_input(x: torch.Tensor, d: int, device: torch.device) -> torch.Tensor:
    if x.shape[-1] != d:
        raise ValueError(f"x must end in the hidden size {d}, got shape {tuple(x.shape)}")
    if x.device.type != device.type:
        raise ValueError(f"x is on {x.device} but this FFN's weights are on {device}")
    return x if x.dim() == 2 else x.reshape(-1, d)


class FlashFFN(nn.Module):
    """One FFN layer served from a flash store through a NeuronCache (see the module doc).

    predictor: callable x [T, d] -> bool [T, n] per-token sets (or one shared set, see Predictor); active_ids: a
    fixed set used for every token; neither: every neuron (exact mode). threshold: sparse_ffn's activation
    threshold (the rule's; 0: none). capacity / window / reader: NeuronCache's; budget_bytes: the layer's, output
    bias included (FlashFFN.bytes_for), the rest the cache's. stats: an FFNStats
    to accumulate into (shared by the layers of a model). overlap: a single token's reads run in a reader thread
    while its already-cached neurons are computed (the exposed and hidden read times are both reported; a shared
    cache has none cached, so its reads run inline). prefill:
    how several tokens with per-token sets read the layer ("union", "sequential" or "auto", see prefill_path). Input
    x [..., d] of any float dtype; computed in `input_dtype` (kernel_input_dtype) with float32 accumulation; output in
    x's dtype.
    device / transfer: where the cache rows live (NeuronCache's); x must be on that device, and the output is too.
    lookahead / ahead_predictor: what a forward does after `prefetch` (LOOKAHEAD_MODES), and the predictor that
    chooses the prefetched set (default: `predictor`). cache: a NeuronCache shared by the model's layers (the
    engine's shared cache layout, for budgets whose per-layer caches would hold less than a token's set): each
    forward first makes it serve this layer (NeuronCache.serve), so nothing is reused across tokens and there is no
    look-ahead, but a set is read and computed in a few large parts; the cache is counted by its owner, not in
    `nbytes`, and capacity / budget_bytes / window / reader / device / transfer are its own. hot_ids: int64 [h]
    neurons pinned in the cache of this layer (NeuronCache pinned_ids; not with a shared cache).
    """

    def __init__(
        self,
        store: FlashStore | str | os.PathLike,
        layer: int,
        *,
        predictor: Predictor | None = None,
        active_ids: torch.Tensor | None = None,
        threshold: float = 0.0,
        capacity: int | None = None,
        budget_bytes: int | None = None,
        window: int = 5,
        reader: FlashReader | None = None,
        stats: FFNStats | None = None,
        overlap: bool = True,
        device: str | torch.device | None = None,
        transfer: Transfer | None = None,
        prefill: str = "auto",
        lookahead: str = "ahead",
        ahead_predictor: Predictor | None = None,
        cache: NeuronCache | None = None,
        hot_ids: torch.Tensor | None = None,
    ):
        super().__init__()
        if prefill not in PREFILL_PATHS:
            raise ValueError(f"prefill must be one of {PREFILL_PATHS}, got {prefill!r}")
        if lookahead not in LOOKAHEAD_MODES:
            raise ValueError(f"lookahead must be one of {LOOKAHEAD_MODES}, got {lookahead!r}")
        self.lookahead, self.ahead_predictor = lookahead, ahead_predictor
        self.prefill = prefill
        self.prefill_paths = {"union": 0, "sequential": 0}  # multi-token forwards per path taken
        self.store = store if isinstance(store, FlashStore) else FlashStore(store)
        if predictor is not None and active_ids is not None:
            raise ValueError("give a predictor or a fixed active_ids set, not both")
        n = self.store.n_neurons
        fixed = torch.arange(n) if active_ids is None else active_ids_of(active_ids, n)
        # Distinct ids, once: the cache steps and the per-row compute take each neuron once.
        self.fixed_ids = None if predictor is not None else self.store.check_ids(fixed).unique()
        self.shares_cache = cache is not None
        if cache is None:
            if capacity is None and budget_bytes is None:
                capacity = n
            if budget_bytes is not None:  # the output bias and a fixed set (bytes_for's shares) come out of it too
                budget_bytes -= 4 * self.store.hidden_size + (0 if self.fixed_ids is None else self.fixed_ids.nbytes)
            cache = NeuronCache(
                self.store,
                layer,
                capacity,
                window,
                budget_bytes=budget_bytes,
                reader=reader,
                device=device,
                transfer=transfer,
                pinned_ids=hot_ids,
            )
        elif hot_ids is not None:
            raise ValueError("a hot set is pinned in a layer's own cache, not in a shared one")
        elif capacity is not None or budget_bytes is not None:
            raise ValueError(
                "a shared cache has its own capacity and budget: give cache or capacity / budget_bytes, not both"
            )
        elif cache.store.path != self.store.path:
            raise ValueError(f"the shared cache serves {cache.store.path}, not {self.store.path}")
        self.cache = cache
        # A shared cache takes each layer's input bias when it starts serving it (a cache of its own holds it).
        self.input_bias = layer_input_bias(self.store, layer) if self.shares_cache else None
        self.layer, self.predictor, self.threshold = layer, predictor, float(threshold)
        self.overlap = overlap
        self.activation = store_activation(self.store)
        self.input_dtype = kernel_input_dtype(self.store, layer)
        out_bias = output_bias(self.store, layer)
        self.register_buffer("out_bias", None if out_bias is None else out_bias.to(self.cache.device), persistent=False)
        self.stats = stats if stats is not None else FFNStats()
        self.last_stats: list[StepStats] = []  # the cache steps of the last forward
        # prefetch's (set, its cache step begun, or None when the set exceeds the cache) for the next forward
        self._ahead: tuple[torch.Tensor, PendingStep | None] | None = None
        self._same_token = False  # the next cache step is the second of a token (after its prefetched set)

    @property
    def nbytes(self) -> int:
        """DRAM this layer holds: its cache (matrix, pointer, bias, per-neuron state; a shared one: its input bias
        instead), output bias and fixed set's ids (exact mode, active_ids)."""
        own = (
            self.cache.nbytes
            if not self.shares_cache
            else (self.input_bias.nbytes if self.input_bias is not None else 0)
        )
        return own + sum(t.nbytes for t in (self.out_bias, self.fixed_ids) if t is not None)

    @staticmethod
    def bytes_for(store: FlashStore, staged: bool = False, every_neuron: bool = False) -> tuple[int, int]:
        """(fixed bytes, bytes per cache row) of one FlashFFN layer over `store`: NeuronCache.bytes_for plus an
        output bias (float32 [d], counted whether or not the model has one) and, every_neuron (exact mode: no
        predictor), the int64 ids of that fixed set."""
        fixed, per_row = NeuronCache.bytes_for(
            store, with_bias=input_bias_role(store) in store.ffn_roles[0], staged=staged
        )
        return fixed + 4 * store.hidden_size + (8 * store.n_neurons if every_neuron else 0), per_row

    def _token_sets(
        self, flat: torch.Tensor, predictor: Predictor | None = None
    ) -> tuple[torch.Tensor | None, torch.Tensor]:
        """(per-token bool masks [T, n] or None when every token shares one set, the shared/union ids), chosen by
        `predictor` (default: this FFN's)."""
        n = self.store.n_neurons
        if self.predictor is None:
            return None, self.fixed_ids
        start = self.cache.transfer.clock()
        # The cache plans on the host: the answer crosses once (on a GPU, the one wait of a layer's step).
        selection = (predictor or self.predictor)(flat).cpu()
        self.stats.predictor_s += self.cache.transfer.clock() - start
        if selection.dtype == torch.bool and selection.dim() == 2:
            if tuple(selection.shape) != (flat.shape[0], n):
                raise ValueError(
                    f"the predictor returned a mask of shape {tuple(selection.shape)}, expected {(flat.shape[0], n)}"
                )
            return selection, active_ids_of(selection, n)
        return None, self.store.check_ids(active_ids_of(selection, n)).unique()

    def _begin(self, ids: torch.Tensor, background: bool = False) -> PendingStep:
        """Begin the cache step of `ids`: the token's second step if its prefetched set was just read."""
        same_token, self._same_token = self._same_token, False
        return self.cache.begin_step(ids, background=background, same_token=same_token)

    def _step(self, ids: torch.Tensor) -> None:
        self._record_step(self._begin(ids).finish(), ids.numel())

    def _record_step(self, step: StepStats, needed: int, prefetch: bool = False) -> None:
        self.last_stats.append(step)
        self.stats.add_step(step, needed, prefetch)

    def prefetch(self, x: torch.Tensor) -> None:
        """Look ahead (as DejaVu does): choose the set of this layer's next forward of one token from x [1, d], an
        estimate of its input known before the layer's attention runs (the engine passes the FFN's norm of the
        layer's input), by `ahead_predictor` (default: the FFN's predictor), and begin that set's cache step with
        the reads in a reader thread, so they overlap the attention. lookahead="ahead": that forward computes
        exactly this set (its own input only meets the kernel's threshold); "prefetch": it computes the set its
        predictor chooses from its own input, reading only what this step did not. Several tokens: nothing (a
        prompt forward chooses its sets itself)."""
        flat = check_ffn_input(x, self.store.hidden_size, self.cache.device)
        if flat.shape[0] != 1 or self.shares_cache:  # (a shared cache: the forward starts from no rows)
            return
        self._finish_ahead()  # a set chosen ahead that no forward took (that forward failed): land its reads
        _, ids = self._token_sets(flat, self.ahead_predictor)
        fits = self.cache.partition(ids)[1].numel() <= self.cache.step_capacity
        self._ahead = (ids, self._begin(ids, background=True) if fits else None)

    def _finish_ahead(self) -> bool:
        """Land the reads of a set chosen ahead (counted as prefetched); whether there were any."""
        ahead, self._ahead = self._ahead, None
        if ahead is None or ahead[1] is None:
            return False
        self._record_step(ahead[1].finish(), 0, prefetch=True)
        return True

    def _step_overlapped(
        self, x: torch.Tensor, ids: torch.Tensor, out: torch.Tensor, pending: PendingStep | None = None
    ) -> None:
        """One token's step over its distinct neuron `ids` (begun already when `pending` is given), with the reads
        in flight while the FFN of the already-cached neurons is computed, then the FFN of the neurons just read:
        the same sum, in two parts."""
        pending = pending if pending is not None else self._begin(ids, background=True)
        cached = self.cache.slot_of[ids] >= 0  # the missing ids map to -1 until finish()
        try:
            self._compute(x, ids[cached], out)
        finally:
            step = pending.finish()  # never leave a read in flight: its rows would be reused
        self._record_step(step, ids.numel())
        self._compute(x, ids[~cached], out)

    def _compute(self, x: torch.Tensor, ids: torch.Tensor, out: torch.Tensor) -> None:
        """out [T, d] float32 += the FFN of x [T, d] over neurons `ids`, all of them cached now."""
        cache = self.cache
        self._compute_rows(x, cache.transfer.to_device(cache.slot_of[ids]), cache.num_used, out)

    def _compute_rows(self, x: torch.Tensor, rows: torch.Tensor | None, num_used: int, out: torch.Tensor) -> None:
        """out [T, d] float32 += the FFN of x [T, d] over the cache's rows `rows` (None: rows [0, num_used))."""
        start = self.cache.transfer.clock()
        cache = self.cache
        y = bundle_ffn(
            self.store,
            x,
            cache.matrix,
            num_used=num_used,
            bias=cache.bias,
            activation=self.activation,
            index=rows,
            threshold=self.threshold,
        )
        out += y  # (fp16 or bf16 y widened in the add)
        self.stats.compute_s += self.cache.transfer.clock() - start

    def _run_set(self, x: torch.Tensor, ids: torch.Tensor, out: torch.Tensor) -> None:
        """The FFN of x over distinct neuron `ids`, in parts whose unpinned neurons fit the cache if they do not
        (the pinned ones with the first part). One token whose set fits reads its misses while its hits are computed
        (overlap); a shared cache has no hits (serve dropped every row), so its parts are read inline into its first
        rows (NeuronCache.load), without a plan or a thread hand-off to wait on."""
        if self.shares_cache:
            # serve held none of this layer's rows: each part is read into rows [0, k) and computed there
            for part in ids.split(self.cache.step_capacity) if ids.numel() else [ids]:
                self._record_step(self.cache.load(part), part.numel())
                self._compute_rows(x, None, part.numel(), out)
            return
        hot, cold = self.cache.partition(ids)
        if x.shape[0] == 1 and self.overlap and cold.numel() <= self.cache.step_capacity:
            self._step_overlapped(x, ids, out)
            return
        for i, part in enumerate(cold.split(self.cache.step_capacity) if cold.numel() else [cold]):
            part = torch.cat([hot, part]) if i == 0 and hot.numel() else part
            self._step(part)
            self._compute(x, part, out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = check_ffn_input(x, self.store.hidden_size, self.cache.device)
        out = torch.zeros(flat.shape, dtype=torch.float32, device=flat.device)
        self._accumulate(flat, as_kernel_input(flat, self.input_dtype), out)
        if self.out_bias is not None:
            out += self.out_bias
        return as_ffn_output(out, x)

    def _accumulate(self, flat: torch.Tensor | None, xs, out: torch.Tensor) -> None:
        """out [T, d] float32 += the FFN (without the output bias) of the T tokens xs [T, d] (input_dtype),
        the per-token sets from the predictor on flat [T, d] (None without a predictor). xs is whatever `_compute`
        computes on (a torch tensor here, an mx.array in flashllm_ext.mlx); the cache steps and planning are
        torch on the host either way."""
        self.last_stats = []
        if self.shares_cache:  # the other layers have used its rows since this one's last forward
            self.cache.serve(self.layer, self.input_bias)
        if self._ahead is not None and out.shape[0] == 1 and self.lookahead == "ahead":  # compute the set chosen
            (ids, pending), self._ahead = self._ahead, None  # ahead, its reads under way
            if pending is None:
                self._run_set(xs, ids, out)
            else:
                self._step_overlapped(xs, ids, out, pending)
            self._end_accumulate(out)
            return
        # lookahead="prefetch": the token's own set continues the step whose reads were begun ahead
        self._same_token = self._finish_ahead() and out.shape[0] == 1
        masks, union = self._token_sets(flat)
        if masks is None or masks.shape[0] == 1:  # one set for every token
            self._run_set(xs, union, out)
        elif self._record_prefill(self.prefill_path(masks)) == "sequential":
            self._prefill_sequential(xs, masks, out)
        else:
            for first, last in self._groups(masks):
                group_union = masks[first:last].any(dim=0).nonzero().flatten()
                if last - first == 1:  # one token: its own set (overlapped, or in parts past the cache)
                    self._run_set(xs[first:last], group_union, out[first:last])
                    continue
                self._step(group_union)
                for t in range(first, last):
                    self._compute(xs[t : t + 1], masks[t].nonzero().flatten(), out[t : t + 1])
        self._end_accumulate(out)

    def _end_accumulate(self, out: torch.Tensor) -> None:
        self._same_token = False  # (an empty set began no step)
        self.stats.tokens += out.shape[0]

    def _record_prefill(self, path: str) -> str:
        self.prefill_paths[path] += 1
        return path

    def _prefill_sequential(self, xs: torch.Tensor, masks: torch.Tensor, out: torch.Tensor) -> None:
        """Every bundle of the layer read in capacity-sized runs of consecutive neurons (a few long reads), each token
        computed over its own active neurons of each run: the same sums as the union path."""
        for part in torch.arange(self.store.n_neurons).split(self.cache.step_capacity):
            self._step(part)
            first = int(part[0])
            for t in range(xs.shape[0]):
                ids = masks[t, first : first + part.numel()].nonzero().flatten() + first
                if ids.numel():
                    self._compute(xs[t : t + 1], ids, out[t : t + 1])

    def prefill_path(self, masks: torch.Tensor) -> str:
        """How a forward of several tokens with per-token sets masks bool [T, n] reads the layer: "union" (each group
        of tokens reads its union's missing bundles, coalesced) or "sequential" (every bundle, in long reads), as
        `prefill` says; "auto" takes the one with the lower estimated read time on the calibrated disk
        (reads x latency / threads + bytes / bandwidth, flashllm_ext.io.disk), without a calibration the one that reads
        fewer bytes (union on a tie). The union path's bytes count every group's union in full after the first:
        groups that do not fit the cache together re-read what an earlier group evicted."""
        if self.prefill != "auto":
            return self.prefill
        profile, reader = load_disk_profile(), self.cache.reader
        latency_s, bandwidth_bps = (0.0, 1.0) if profile is None else (profile.latency_s, profile.bandwidth_bps)
        row, n = self.store.row_bytes, self.store.n_neurons
        union_reads = union_bytes = 0
        cached = self.cache.slot_of >= 0
        for first, last in self._groups(masks):
            missing = masks[first:last].any(dim=0) & ~cached
            cached = torch.zeros_like(cached)  # a later group finds the earlier ones' rows evicted (upper bound)
            ids = missing.nonzero().flatten()
            union_bytes += ids.numel() * row
            # one read per run of neurons whose gaps the reader does not read through
            union_reads += int((ids.diff() * row > reader.max_gap + row).sum()) + 1 if ids.numel() else 0
        sequential_bytes = n * row
        sequential_reads = -(-sequential_bytes // max(reader.max_read, row))

        def seconds(reads: int, nbytes: int) -> float:
            return reads * latency_s / reader.threads + nbytes / bandwidth_bps

        return (
            "sequential" if seconds(sequential_reads, sequential_bytes) < seconds(union_reads, union_bytes) else "union"
        )

    def _groups(self, masks: torch.Tensor) -> list[tuple[int, int]]:
        """Consecutive token ranges [first, last) whose union of active unpinned neurons fits the cache (a token
        whose own set does not fit is a range of its own)."""
        capacity, groups, first = self.cache.step_capacity, [], 0
        union = torch.zeros(masks.shape[1], dtype=torch.bool)
        unpinned = ~self.cache.pinned
        for t in range(masks.shape[0]):
            grown = union | masks[t]
            if t > first and int((grown & unpinned).sum()) > capacity:
                groups.append((first, t))
                first, grown = t, masks[t].clone()
            union = grown
        if masks.shape[0]:
            groups.append((first, masks.shape[0]))
        return groups
