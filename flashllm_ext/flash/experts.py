"""Experts on flash: a mixture-of-experts layer's experts read from an MoE store (FlashStore.experts) when its router
names them, and kept in an ExpertCache of preallocated slots within the DRAM budget.

Per layer and forward: the router (the model's own, exact: nothing is predicted) names each token's top_k experts;
those the cache holds are computed at once, the others are read, each expert one contiguous range of the file (its
`size` bundles), into the slots the policy frees, and computed. A prompt's tokens read the union of their experts,
in rounds of at most `capacity` experts.

Policies (EXPERT_POLICIES): which expert leaves when a miss needs a slot and none is free.
  lru     the least recently used expert
  lfu     the least often used since load (the least recently used among equals)
  window  LLM in a flash's sliding window: the cache holds the experts of the last `window` tokens, at most
          window x top_k slots a layer (fewer than the budget allows when that is smaller), the least recent
          out first; it trades hits for DRAM where LRU would fill the budget
Modes (EXPERT_MODES, expert_stack): dense (every expert read once at load), naive (a forward's experts read every
time into top_k slots, nothing kept between forwards), flash (the cache by its policy).

Read-ahead (flash mode, `ExpertFFN.prefetch`): the decoder applies layer l+1's router to layer l's hidden state
before layer l's FFN (pre-gating) and the guessed experts not held are read in the background while layer l computes;
layer l+1's forward waits for them, then reads what its real router names beyond the guess. Reported: the guess's
recall (`stats()["ahead_recall"]`) and the read time that overlapped compute (`hidden_io_ms`).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

import torch

from flashllm_ext.flash.ffn import FFNStats, bundle_ffn, store_activation
from flashllm_ext.flash.reader import FlashReader
from flashllm_ext.flash.stack import FlashRuntime, bounded_reader_options
from flashllm_ext.flash.store import FlashStore
from flashllm_ext.runtime import bound_heap_retention

EXPERT_POLICIES = ("lru", "lfu", "window")
EXPERT_MODES = ("dense", "naive", "flash")
Route = Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]]  # x [T, d] -> experts, weights [T, top_k]
FFN = Callable[[torch.Tensor], torch.Tensor]


class ExpertCache:
    """One layer's expert slots: `slots` [capacity, size, row_width] of the store's row dtype, which expert each
    holds (`slot_of`), and the policy's clock (a tick per forward) and use counts. lookup / admit / touch / forget
    are its whole state machine; the ExpertFFN reads into the slots admit hands out."""

    def __init__(
        self,
        n_experts: int,
        capacity: int,
        size: int,
        row_width: int,
        dtype: torch.dtype,
        policy: str = "lru",
    ):
        if policy not in EXPERT_POLICIES:
            raise ValueError(f"policy must be one of {EXPERT_POLICIES}, got {policy!r}")
        if not 1 <= capacity <= n_experts:
            raise ValueError(f"capacity must lie in [1, {n_experts}] experts, got {capacity}")
        self.n_experts, self.capacity, self.policy = n_experts, capacity, policy
        self.slots = torch.empty((capacity, size, row_width), dtype=dtype)
        self.slot_of: dict[int, int] = {}
        self.expert_in = [-1] * capacity  # -1: a free slot
        self.last_used = [0] * capacity
        self.uses = [0] * n_experts
        self.clock = 0

    @property
    def nbytes(self) -> int:
        return self.slots.nbytes

    def tick(self) -> None:
        """A new forward: what it touches is more recent than anything before."""
        self.clock += 1

    def lookup(self, experts: Sequence[int]) -> tuple[list[tuple[int, int]], list[int]]:
        """(expert, slot) of the `experts` held, and those not held, each in the given order."""
        hits = [(e, self.slot_of[e]) for e in experts if e in self.slot_of]
        return hits, [e for e in experts if e not in self.slot_of]

    def touch(self, experts: Sequence[int], count: bool = True) -> None:
        """`experts` used by this forward (held or about to be): recency for every policy, and (count) a use for
        lfu; a read-ahead's guesses are recent, not used."""
        for e in experts:
            self.uses[e] += count
            if e in self.slot_of:
                self.last_used[self.slot_of[e]] = self.clock

    def admit(self, experts: Sequence[int]) -> list[tuple[int, int]]:
        """A slot for each of `experts` (not held, at most `capacity`): free slots first, then the policy's victims,
        never one of `experts` themselves. The slots are theirs from now on; the caller reads into them."""
        if len(experts) > self.capacity or any(e in self.slot_of for e in experts):
            raise ValueError(f"admit takes at most {self.capacity} experts not held, got {list(experts)}")
        free = [s for s, e in enumerate(self.expert_in) if e < 0]
        victims = sorted(
            (s for s, e in enumerate(self.expert_in) if e >= 0),
            key=lambda s: (
                (self.uses[self.expert_in[s]], self.last_used[s]) if self.policy == "lfu" else self.last_used[s]
            ),
        )
        pairs = []
        for e, s in zip(experts, free + victims):
            if self.expert_in[s] >= 0:
                del self.slot_of[self.expert_in[s]]
            self.expert_in[s], self.slot_of[e], self.last_used[s] = e, s, self.clock
            pairs.append((e, s))
        return pairs

    def forget(self) -> None:
        """Hold nothing (naive mode, before each forward)."""
        self.slot_of.clear()
        self.expert_in = [-1] * self.capacity


class ExpertFFN:
    """One MoE layer's FFN: route(x) names the experts, `cache` holds them (read through `reader` on a miss),
    shared(x) (Qwen2-MoE's shared expert) is added when given. x [T, d] float32 -> [T, d] float32. naive: forget
    the cache before every forward (naive mode). Costs accumulate in `stats` (neurons: an expert counts its size)."""

    def __init__(
        self,
        store: FlashStore,
        layer: int,
        route: Route,
        cache: ExpertCache,
        reader: FlashReader,
        stats: FFNStats,
        shared: FFN | None = None,
        naive: bool = False,
    ):
        self.store, self.layer, self.route, self.cache = store, layer, route, cache
        self.reader, self.stats, self.shared, self.naive = reader, stats, shared, naive
        self.size = store.experts.size
        self.activation = store_activation(store)
        self.pending: list = []  # read-ahead: the background reads of the guessed experts (futures)
        self.guess: set[int] | None = None  # the experts the last prefetch guessed, until the forward

    def prefetch(self, x: torch.Tensor) -> None:
        """Guess this layer's next experts by routing x (an earlier hidden state, [1, d]) and start reading those
        not held into slots of their own (at most capacity of them), in the background."""
        start = time.perf_counter()
        guessed = self.route(x)[0].unique().tolist()
        self.stats.predictor_s += time.perf_counter() - start
        start = time.perf_counter()
        cache = self.cache
        cache.tick()
        cache.touch(guessed, count=False)  # (guessed experts held stay while the guesses not held are admitted)
        self.guess = set(guessed)
        _, misses = cache.lookup(guessed)
        pairs = cache.admit(misses[: cache.capacity])
        self.stats.mem_s += time.perf_counter() - start
        self.pending = [self.reader.read_async(self.layer, self._rows(e), cache.slots[s]) for e, s in pairs]
        self.stats.prefetched += len(pairs) * self.size

    def _land(self) -> None:
        """Wait for the read-ahead of this layer: the wait is exposed read time, the rest of its reads' time hid
        behind compute."""
        start = time.perf_counter()
        reads = [future.result().stats for future in self.pending]
        waited = time.perf_counter() - start
        self.pending = []
        self._count(reads)
        self.stats.io_s += waited
        self.stats.hidden_io_s += max(0.0, sum(r.wall_s for r in reads) - waited)

    def _rows(self, expert: int) -> torch.Tensor:
        return torch.arange(expert * self.size, (expert + 1) * self.size)

    def _count(self, reads) -> None:
        for read in reads:
            self.stats.bytes_read += read.bytes_read
            self.stats.bytes_requested += read.bytes_requested
            self.stats.n_reads += read.n_reads
            self.stats.decompress_s += read.decompress_s

    @property
    def nbytes(self) -> int:
        return self.cache.nbytes

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.pending:
            self._land()
        start = time.perf_counter()
        experts, weights = self.route(x)
        self.stats.predictor_s += time.perf_counter() - start
        out = self.routed(x, experts, weights)
        if self.shared is not None:
            start = time.perf_counter()
            out += self.shared(x)
            self.stats.compute_s += time.perf_counter() - start
        return out

    def routed(self, x: torch.Tensor, experts: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """sum over k of weights[t, k] * expert experts[t, k] (x[t]): x [T, d] float32, experts int64 and weights
        float32 [T, top_k] (a router's answer) -> float32 [T, d]; the experts not held are read first."""
        stats, cache = self.stats, self.cache
        start = time.perf_counter()
        needed = experts.unique().tolist()
        if self.naive:
            cache.forget()
        if self.guess is None:  # no read-ahead for this token: its tick is the forward's
            cache.tick()
        else:
            stats.guessed += len(self.guess.intersection(needed)) * self.size
            self.guess = None
        cache.touch(needed)
        hits, misses = cache.lookup(needed)
        stats.mem_s += time.perf_counter() - start
        out = torch.zeros(x.shape, dtype=torch.float32)
        xs = x.to(self.store.dtype)
        self._compute(xs, experts, weights, hits, out)
        for first in range(0, len(misses), cache.capacity):
            start = time.perf_counter()
            pairs = cache.admit(misses[first : first + cache.capacity])
            stats.mem_s += time.perf_counter() - start
            self._read(pairs)
            self._compute(xs, experts, weights, pairs, out)
        stats.tokens += x.shape[0]
        stats.steps += 1
        stats.needed += len(needed) * self.size
        stats.inserted += len(misses) * self.size
        return out

    def _read(self, pairs: list[tuple[int, int]]) -> None:
        """Each expert of `pairs` into its slot: one contiguous range of the file, the reader's threads splitting it."""
        start = time.perf_counter()
        self._count([self.reader.read(self.layer, self._rows(e), self.cache.slots[s]).stats for e, s in pairs])
        self.stats.io_s += time.perf_counter() - start

    def _compute(
        self,
        xs: torch.Tensor,
        experts: torch.Tensor,
        weights: torch.Tensor,
        pairs: list[tuple[int, int]],
        out: torch.Tensor,
    ) -> None:
        """out[t] += weight(t, e) * expert e (x[t]) for every token t routed to each expert of `pairs` (held now)."""
        start = time.perf_counter()
        for expert, slot in pairs:
            tokens, rank = (experts == expert).nonzero(as_tuple=True)
            y = bundle_ffn(
                self.store, xs[tokens], self.cache.slots[slot], num_used=self.size, activation=self.activation
            )
            out.index_add_(0, tokens, y.float() * weights[tokens, rank, None])
        self.stats.compute_s += time.perf_counter() - start


def expert_stack(
    store: FlashStore,
    mode: str,
    budget_bytes: int | None,
    *,
    routes: Sequence[Route],
    top_k: int,
    shared: Sequence[FFN | None] | None = None,
    policy: str = "lru",
    window: int = 5,
    threads: int = 32,
    resident_bytes: int = 0,
    reader_options: dict | None = None,
) -> FlashRuntime:
    """Every MoE layer of `store` served by `mode` (EXPERT_MODES) within `budget_bytes` (None: none; dense mode
    takes none), of which `resident_bytes` are taken already (the decoder's own tensors and KV cache): runtime.
    modules[i](x) is layer i's FFN. routes[i]: layer i's router; shared[i]: its shared expert or None. The slots
    per layer: every expert (dense), top_k (naive), as many as the budget holds (flash; window: at most window x
    top_k). ValueError for a budget below one expert a layer, naming the minimum."""
    if store.experts is None:
        raise ValueError(f"{store.path} is not a mixture-of-experts store")
    if mode not in EXPERT_MODES:
        raise ValueError(f"an MoE store runs in one of the modes {EXPERT_MODES}, not {mode!r}")
    if policy not in EXPERT_POLICIES:
        raise ValueError(f"expert policy must be one of {EXPERT_POLICIES}, got {policy!r}")
    n_layers, n_experts, size = store.n_layers, store.experts.count, store.experts.size
    if len(routes) != n_layers or (shared is not None and len(shared) != n_layers):
        raise ValueError(f"routes (and shared) must give one per layer: {n_layers}")
    budget_bytes = None if mode == "dense" else budget_bytes
    if budget_bytes is not None:
        bound_heap_retention()
    reader_options = {**bounded_reader_options(store, budget_bytes, resident_bytes), **(reader_options or {})}
    reader = FlashReader(store, threads=threads, **reader_options)
    expert_bytes = size * store.row_bytes
    fixed = resident_bytes + reader.buffer_bound()
    capacity = {"dense": n_experts, "naive": top_k, "flash": n_experts}[mode]
    if policy == "window" and mode == "flash":
        capacity = min(capacity, window * top_k)
    if budget_bytes is not None:
        fits = (budget_bytes - fixed) // (n_layers * expert_bytes)
        if fits < 1:
            reader.close()
            raise ValueError(
                f"dram_budget of {budget_bytes} bytes is below the minimum of {fixed + n_layers * expert_bytes} "
                f"for {mode} mode ({fixed} resident tensors, KV cache and read buffers + one expert of "
                f"{expert_bytes} bytes in each of {n_layers} layers)"
            )
        capacity = min(capacity, fits)
    stats = FFNStats()
    modules = []
    try:
        for layer in range(n_layers):
            cache = ExpertCache(n_experts, capacity, size, store.row_width, store.row_dtype, policy)
            if mode == "dense":  # every expert in its own slot, one read of the layer
                cache.admit(list(range(n_experts)))
                reader.read(layer, torch.arange(store.n_neurons), cache.slots.view(store.n_neurons, -1))
            modules.append(
                ExpertFFN(
                    store,
                    layer,
                    routes[layer],
                    cache,
                    reader,
                    stats,
                    shared=None if shared is None else shared[layer],
                    naive=mode == "naive",
                )
            )
    except BaseException:
        reader.close()
        raise
    ffn_bytes = sum(m.nbytes for m in modules) + reader.buffer_bound()
    return FlashRuntime(
        store,
        mode,
        budget_bytes,
        resident_bytes,
        0,
        ffn_bytes,
        modules,
        stats,
        reader,
        expert_policy=policy if mode == "flash" else None,
    )
