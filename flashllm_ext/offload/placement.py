"""Placement: which decoder layers live on the device, in host memory and on SSD, within the budgets."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from flashllm_ext.flash.reader import MAX_THREADS
from flashllm_ext.offload.store import LayerStore


MODES = ("dense", "endor", "endor+more-resident")
COMPUTES = ("auto", "linear", "decompress")
# Prompts decompress an Endor matrix a block of rows at a time, at most this many dense bytes (at least one row), each
# block multiplied while it is in cache: the buffer is charged to the budget beside the layers, and a whole
# OPT-6.7B fc1 (134 MB) would take a layer's room.
DECOMPRESS_BLOCK_BYTES = 8 << 20


# ------------------------------------------------------------------------------------------ placement, install


@dataclass(frozen=True)
class Placement:
    """Where each decoder layer lives, nearest first, and the bytes that costs.

    Layers [0, on_device) are computed where they lie: in memory on the CPU, in GPU memory on CUDA (dense, or as
    stored in endor+more-resident). Layers [on_device, in_memory) are held in host memory as stored (compressed in
    the Endor modes) and copied into a slot on the device before each use: the GPU's CPU tier. Layers [in_memory,
    n_layers) are read from the store into a slot before each use. On the CPU, on_device == in_memory unless a
    staged tier is asked for (layers_on_device=), which runs the GPU's three-tier code path where there is no GPU.

    device_layer_bytes: the on-device layers; host_layer_bytes: the staged tier (pinned on CUDA, page by page:
    transfer.pinned_buffer); slot_bytes: the `slots` buffers moved layers land in (two: the next layer's fetch
    overlaps this one's compute; one: a layer's room more, the fetch after the compute); decompress_bytes: the
    buffer Endor matrices are decompressed into for prompts, a block of rows at a time (decompress_block_rows);
    bounce_bytes: the pinned host memory SSD layers pass through on their way to a GPU (reader.host_bounce_bytes:
    one buffer as large as a layer when kvikio is absent, kvikio's pool of bounce buffers in its compatibility
    mode)."""

    n_layers: int
    on_device: int
    in_memory: int
    slots: int
    device_layer_bytes: int
    host_layer_bytes: int
    slot_bytes: int
    decompress_bytes: int
    bounce_bytes: int

    @property
    def device_bytes(self) -> int:
        return self.device_layer_bytes + self.slot_bytes + self.decompress_bytes

    @property
    def host_bytes(self) -> int:
        return self.host_layer_bytes + self.bounce_bytes

    def tier(self, layer: int) -> str:
        """ "resident" (computed where it lies), "staged" (in host memory, copied to a slot per use) or "ssd"."""
        return "resident" if layer < self.on_device else "staged" if layer < self.in_memory else "ssd"


def decompress_block_rows(rows: int, cols: int, itemsize: int) -> int:
    """Rows of an Endor matrix [rows, cols] a prompt decompresses at a time: DECOMPRESS_BLOCK_BYTES of dense rows, at
    least one, at most all."""
    return max(1, min(rows, DECOMPRESS_BLOCK_BYTES // (cols * itemsize)))


def _placement(
    store: LayerStore, mode: str, on_device: int, in_memory: int, slots: int, bounce: Callable[[int], int] | None
) -> Placement:
    n, item = store.n_layers, store.dtype.itemsize
    keep_compressed = mode == "endor+more-resident"
    moved = [store.stored_bytes(i) for i in range(on_device, n)]
    # Endor matrices computed from their compressed form (moved layers, and on-device ones kept compressed) are
    # decompressed into one buffer for prompts, a block of rows at a time.
    decompress = max(
        (
            decompress_block_rows(*e.shape, item) * e.shape[1] * item
            for i in range(n)
            for e in store.layers[i]
            if e.endor and (i >= on_device or keep_compressed)
        ),
        default=0,
    )
    largest_on_ssd = max((store.stored_bytes(i) for i in range(in_memory, n)), default=0)
    return Placement(
        n,
        on_device,
        in_memory,
        slots,
        sum(store.stored_bytes(i) if keep_compressed else store.dense_bytes(i) for i in range(on_device)),
        sum(store.stored_bytes(i) for i in range(on_device, in_memory)),
        slots * max(moved, default=0),
        decompress,
        bounce(largest_on_ssd) if bounce and largest_on_ssd else 0,
    )


def plan_placement(
    store: LayerStore,
    mode: str,
    layer_budget: int | None,
    layers_in_memory: int | None = None,
    *,
    device_layer_budget: int | None = None,
    separate: bool = False,
    bounce: Callable[[int], int] | None = None,
    layers_on_device: int | None = None,
    slots: int = 2,
) -> Placement:
    """The placement, nearest first, within the budgets left for layers (None: no limit).

    separate=False (the CPU): one pool, `layer_budget`, holds every byte of the Placement; layers_on_device
    defaults to layers_in_memory, i.e. no staged tier. separate=True (a GPU): the device's pool
    (`device_layer_budget`) holds Placement.device_bytes and sets layers_on_device; the host's (`layer_budget`)
    holds Placement.host_bytes (the bounce buffers, `bounce`(bytes of the largest SSD layer), none when None; then
    the staged tier). Given counts are kept if they fit (a placement to compare modes on); otherwise the most layers
    that fit. `slots`: 1 or 2 (Placement). Raises ValueError when given counts do not fit (BudgetTooSmall, naming
    the pool, when not even zero layers do)."""
    check_options(store, mode, slots=slots, layers_in_memory=layers_in_memory, layers_on_device=layers_on_device)
    for name, value in (("layer_budget", layer_budget), ("device_layer_budget", device_layer_budget)):
        if value is not None and not is_int(value):
            raise ValueError(f"{name} must be bytes (an int) or None, got {value!r}")
    n = store.n_layers

    def device_fits(p: Placement) -> bool:
        return not separate or device_layer_budget is None or p.device_bytes <= device_layer_budget

    def host_fits(p: Placement) -> bool:
        need = p.host_bytes if separate else p.host_bytes + p.device_bytes
        return layer_budget is None or need <= layer_budget

    given = layers_in_memory is not None or layers_on_device is not None
    g = layers_on_device
    if separate and g is None:
        on_device = [g for g in range(n + 1) if device_fits(_placement(store, mode, g, g, slots, bounce))]
        if not on_device:
            raise BudgetTooSmall(_placement(store, mode, 0, 0, slots, bounce).device_bytes, "device")
        g = on_device[-1] if layers_in_memory is None else min(on_device[-1], layers_in_memory)
    if layers_in_memory is not None:
        counts = [(layers_in_memory if g is None else g, layers_in_memory)]
    else:  # without a staged tier (g None) the layers in memory are all on the device
        counts = [(k, k) for k in range(n + 1)] if g is None else [(g, k) for k in range(g, n + 1)]
    plans = [_placement(store, mode, on, k, slots, bounce) for on, k in counts]
    fitting = [p for p in plans if device_fits(p) and host_fits(p)]
    if fitting:
        return fitting[-1]
    p = plans[0]
    if not given:
        raise BudgetTooSmall(p.host_bytes if separate else p.host_bytes + p.device_bytes, "host")
    if separate:
        raise ValueError(
            f"{p.on_device} layers on the device and {p.in_memory} in memory in {mode} mode need "
            f"{p.device_bytes} bytes of device memory and {p.host_bytes} of host memory for the layers "
            f"and their buffers; the budgets leave {device_layer_budget} and {layer_budget}"
        )
    staged = f" ({p.in_memory - p.on_device} of them staged)" if p.on_device < p.in_memory else ""
    raise ValueError(
        f"{p.in_memory} layers in memory in {mode} mode{staged} need "
        f"{p.device_bytes + p.host_bytes} bytes for the layers and staging, {layer_budget} are left of "
        f"the budget"
    )


def default_slots(device: torch.device) -> int:
    """Fetch slots when none are asked for: one on a GPU, whose decode layer computes in milliseconds beside a fetch
    of hundreds, so the room for one more layer in memory is worth more than the overlap (1.28-1.52x per token on an
    H200, BENCHMARKS.md "GPU run"); two on the CPU, where a layer's compute is long enough to hide a fetch."""
    return 1 if device.type == "cuda" else 2


def is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def store_mode(store: LayerStore) -> str:
    """The mode a store runs in when none is asked for: endor for an Endor store, dense for any other."""
    return "endor" if store.endor else "dense"


def check_options(
    store: LayerStore,
    mode: str,
    *,
    compute: str = "auto",
    threads: int = 1,
    slots: int | None = 2,
    layers_in_memory: int | None = None,
    layers_on_device: int | None = None,
) -> None:
    """ValueError (TypeError for a store that is not a LayerStore) naming the first bad argument, before any work."""
    if not isinstance(store, LayerStore):
        raise TypeError(f"store must be a LayerStore, got {type(store).__name__}")
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    if (mode != "dense") != store.endor:
        raise ValueError(
            f"{mode} mode needs {'an Endor' if mode != 'dense' else 'a dense'} layer store; {store.path} "
            f"is {'Endor' if store.endor else 'dense'} (convert_offload endor_compress=)"
        )
    if compute not in COMPUTES:
        raise ValueError(f"compute must be one of {COMPUTES}, got {compute!r}")
    if not is_int(threads) or not 1 <= threads <= MAX_THREADS:
        raise ValueError(f"threads must be an int in [1, {MAX_THREADS}], got {threads!r}")
    if slots is not None and (not is_int(slots) or slots not in (1, 2)):
        raise ValueError(f"slots must be 1, 2 or None, got {slots!r}")
    n = store.n_layers
    for name, value in (("layers_on_device", layers_on_device), ("layers_in_memory", layers_in_memory)):
        if value is not None and (not is_int(value) or not 0 <= value <= n):
            raise ValueError(f"{name} must be an int in [0, {n}], got {value!r}")
    if layers_on_device is not None and layers_in_memory is not None and layers_on_device > layers_in_memory:
        raise ValueError(f"layers_on_device ({layers_on_device}) exceeds layers_in_memory ({layers_in_memory})")


class BudgetTooSmall(ValueError):
    def __init__(self, need: int, pool: str):
        super().__init__(
            f"offloading needs at least {need} bytes of {pool} memory for the layers' buffers, beside "
            f"the resident tensors"
        )
        self.need, self.pool = need, pool
