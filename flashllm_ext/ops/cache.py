"""cache_compact and cache_plan: the neuron cache's swap-delete eviction and its per-token plan.

Each op: schema, checks (worded as the native kernels word them, csrc/common/<op>_checks.h), pure-torch
reference kernel (registered as CompositeExplicitAutograd: every device without a native kernel, the test
oracle and the benchmark baseline), fake kernel, and the typed wrapper library code calls.
"""

from __future__ import annotations


import torch

from flashllm_ext.ops.library import LIB


# ------------------------------------------------------------------------------------------------ cache_compact
# Swap-delete of cache rows: the rows listed in `rows` (distinct, < num_used) are removed and the last used rows
# move into the holes, carrying their pointer entry and bias; slot_of (neuron id -> row, -1 when absent) follows.
# Returns the new num_used (= num_used - rows.numel()).
LIB.define(
    "cache_compact(Tensor(a!) matrix, Tensor(b!) pointer, Tensor(c!)? bias, Tensor(d!)? slot_of, int num_used, "
    "Tensor rows) -> int"
)


def _check_cache_compact_metadata(
    matrix: torch.Tensor,
    pointer: torch.Tensor,
    bias: torch.Tensor | None,
    slot_of: torch.Tensor | None,
    num_used: int,
    rows: torch.Tensor,
) -> None:
    """The metadata checks of csrc/common/cache_compact_checks.h."""
    torch._check(
        matrix.dim() == 2 and matrix.is_contiguous(),
        lambda: f"cache_compact: matrix must be a contiguous 2-D tensor, got shape {tuple(matrix.shape)}",
    )
    capacity = matrix.shape[0]
    torch._check(
        pointer.dtype == torch.int64 and tuple(pointer.shape) == (capacity,),
        lambda: (
            f"cache_compact: pointer must be int64 of shape [capacity={capacity}], got {pointer.dtype} "
            f"of shape {tuple(pointer.shape)}"
        ),
    )
    torch._check(
        bias is None or (bias.dim() == 1 and bias.shape[0] == capacity),
        lambda: f"cache_compact: bias must be 1-D of shape [capacity={capacity}], got shape {tuple(bias.shape)}",
    )
    torch._check(
        slot_of is None or (slot_of.dtype == torch.int64 and slot_of.dim() == 1),
        lambda: (
            f"cache_compact: slot_of must be a 1-D int64 tensor, got {slot_of.dtype} of shape {tuple(slot_of.shape)}"
        ),
    )
    torch._check(
        rows.dtype == torch.int64 and rows.dim() == 1,
        lambda: f"cache_compact: rows must be a 1-D int64 tensor, got {rows.dtype} of shape {tuple(rows.shape)}",
    )
    for name, t in (("pointer", pointer), ("bias", bias), ("slot_of", slot_of), ("rows", rows)):
        torch._check(
            t is None or t.device == matrix.device,
            lambda: f"cache_compact: {name} is on {t.device} but matrix is on {matrix.device}",
        )
    torch._check(
        0 <= num_used <= capacity, lambda: f"cache_compact: num_used={num_used} is outside [0, capacity={capacity}]"
    )
    # Contiguity is what lets the native kernels move rows and entries with plain pointer arithmetic.
    torch._check(
        all(t is None or t.is_contiguous() for t in (pointer, bias, slot_of)),
        lambda: "cache_compact: pointer, bias and slot_of must be contiguous (they are updated in place)",
    )


def check_cache_compact_args(
    matrix: torch.Tensor,
    pointer: torch.Tensor,
    bias: torch.Tensor | None,
    slot_of: torch.Tensor | None,
    num_used: int,
    rows: torch.Tensor,
) -> None:
    """Every check the native kernels make, in torch (data included: rows distinct and < num_used)."""
    _check_cache_compact_metadata(matrix, pointer, bias, slot_of, num_used, rows)
    if rows.numel():
        outside = (rows < 0) | (rows >= num_used)
        if bool(outside.any()):
            k = int(outside.nonzero()[0])
            raise RuntimeError(f"cache_compact: rows[{k}]={int(rows[k])} is outside [0, num_used={num_used})")
        if torch.unique(rows).numel() != rows.numel():
            raise RuntimeError("cache_compact: rows holds a row twice")
    if slot_of is not None and num_used:
        ids = pointer[:num_used]
        if int(ids.min()) < 0 or int(ids.max()) >= slot_of.numel():
            raise RuntimeError(
                f"cache_compact: pointer[:num_used] holds neuron ids outside [0, slot_of.numel()={slot_of.numel()})"
            )


def compaction_moves(num_used: int, rows: list[int]) -> list[tuple[int, int]]:
    """The (source, hole) row moves of a swap-delete: the holes below the new end, ascending, are filled by the
    surviving rows at or past it, ascending. Every kernel makes exactly these moves."""
    new_used = num_used - len(rows)
    deleted = set(rows)
    holes = sorted(r for r in rows if r < new_used)
    sources = [r for r in range(new_used, num_used) if r not in deleted]
    return list(zip(sources, holes))


def cache_compact_reference(
    matrix: torch.Tensor,
    pointer: torch.Tensor,
    bias: torch.Tensor | None,
    slot_of: torch.Tensor | None,
    num_used: int,
    rows: torch.Tensor,
) -> int:
    """Swap-delete in place; O(c * row) for c deleted rows. Returns the new num_used."""
    check_cache_compact_args(matrix, pointer, bias, slot_of, num_used, rows)
    deleted = rows.tolist()
    if slot_of is not None and deleted:
        slot_of[pointer[rows]] = -1
    for source, hole in compaction_moves(num_used, deleted):
        matrix[hole] = matrix[source]
        pointer[hole] = pointer[source]
        if bias is not None:
            bias[hole] = bias[source]
        if slot_of is not None:
            slot_of[pointer[hole]] = hole
    new_used = num_used - len(deleted)
    pointer[new_used:num_used] = -1
    return new_used


@torch.library.impl(LIB, "cache_compact", "CompositeExplicitAutograd")
def _cache_compact_default(matrix, pointer, bias, slot_of, num_used, rows):
    return cache_compact_reference(matrix, pointer, bias, slot_of, num_used, rows)


@torch.library.register_fake("flashllm::cache_compact")
def _cache_compact_fake(matrix, pointer, bias, slot_of, num_used, rows):
    _check_cache_compact_metadata(matrix, pointer, bias, slot_of, num_used, rows)
    return num_used - rows.shape[0]


# ------------------------------------------------------------------------------------------------ cache_plan
# One token's decisions of the neuron cache (flashllm_ext/flash/cache.py), in place on its preallocated state:
# last_active[n] = step for the active ids; evict_rows[:w] = rows whose neuron was not active in the last `window`
# steps, evict_rows[w:w+b] = the least recently active other rows when the window's union would not fit (never a row
# active now); missing[:m] = the distinct active ids not cached. Returns [w, b, m]. Raises, changing nothing, when
# the token alone has more distinct active neurons than the cache has rows. CPU only (the state is small).
LIB.define(
    "cache_plan(Tensor active_ids, Tensor(a!) last_active, Tensor slot_of, Tensor pointer, int num_used, int step, "
    "int window, Tensor(b!) evict_rows, Tensor(c!) missing) -> SymInt[]"
)


def _check_cache_plan_metadata(
    active_ids: torch.Tensor,
    last_active: torch.Tensor,
    slot_of: torch.Tensor,
    pointer: torch.Tensor,
    num_used: int,
    window: int,
    evict_rows: torch.Tensor,
    missing: torch.Tensor,
) -> None:
    """The metadata checks of csrc/common/cache_plan_checks.h."""
    tensors = (active_ids, last_active, slot_of, pointer, evict_rows, missing)
    for t in tensors:
        torch._check(
            t.dtype == torch.int64 and t.dim() == 1 and t.device.type == "cpu",
            lambda: (
                f"cache_plan: every argument must be a 1-D int64 CPU tensor, got {t.dtype} of shape "
                f"{tuple(t.shape)} on {t.device}"
            ),
        )
    torch._check(all(t.is_contiguous() for t in tensors[1:]), lambda: "cache_plan: state tensors must be contiguous")
    torch._check(
        last_active.numel() == slot_of.numel(),
        lambda: (
            f"cache_plan: last_active and slot_of must both have one entry per neuron, got "
            f"{last_active.numel()} and {slot_of.numel()}"
        ),
    )
    capacity = pointer.numel()
    torch._check(
        evict_rows.numel() >= capacity and missing.numel() >= capacity,
        lambda: f"cache_plan: evict_rows and missing need capacity={capacity} entries",
    )
    torch._check(
        0 <= num_used <= capacity, lambda: f"cache_plan: num_used={num_used} is outside [0, capacity={capacity}]"
    )
    torch._check(window >= 1, lambda: f"cache_plan: window must be >= 1, got {window}")


def cache_plan_reference(
    active_ids: torch.Tensor,
    last_active: torch.Tensor,
    slot_of: torch.Tensor,
    pointer: torch.Tensor,
    num_used: int,
    step: int,
    window: int,
    evict_rows: torch.Tensor,
    missing: torch.Tensor,
) -> list[int]:
    """Pure-torch cache_plan (ties among least recently active rows go to the lower row)."""
    _check_cache_plan_metadata(active_ids, last_active, slot_of, pointer, num_used, window, evict_rows, missing)
    n_neurons, capacity = slot_of.numel(), pointer.numel()
    ids = active_ids.tolist()
    cached = pointer[:num_used]
    if num_used and not (
        bool(((cached >= 0) & (cached < n_neurons)).all()) and torch.equal(slot_of[cached], torch.arange(num_used))
    ):
        i = next(i for i, n in enumerate(cached.tolist()) if not 0 <= n < n_neurons or int(slot_of[n]) != i)
        raise RuntimeError(
            f"cache_plan: pointer[{i}]={int(cached[i])} disagrees with slot_of: the cache state is corrupt"
        )
    for i, n in enumerate(ids):
        if not 0 <= n < n_neurons:
            raise RuntimeError(f"cache_plan: active_ids[{i}]={n} is outside [0, n_neurons={n_neurons})")
        slot = int(slot_of[n])
        if slot >= 0 and not (slot < num_used and int(pointer[slot]) == n):
            raise RuntimeError(f"cache_plan: slot_of[{n}]={slot} disagrees with pointer: the cache state is corrupt")
    distinct = list(dict.fromkeys(ids))
    if len(distinct) > capacity:
        raise RuntimeError(
            f"cache_plan: the token has {len(distinct)} distinct active neurons but the cache holds "
            f"{capacity} rows; raise the byte budget"
        )
    absent = [n for n in distinct if int(slot_of[n]) < 0]
    if ids:
        last_active[active_ids] = step
    when = last_active[cached].tolist()
    window_out = [i for i in range(num_used) if when[i] <= step - window]
    over = num_used - len(window_out) + len(absent) - capacity
    budget_out = []
    if over > 0:
        candidates = sorted((when[i], i) for i in range(num_used) if step - window < when[i] != step)
        budget_out = [i for _, i in candidates[:over]]
    out = window_out + budget_out
    evict_rows[: len(out)] = torch.tensor(out, dtype=torch.int64)
    missing[: len(absent)] = torch.tensor(absent, dtype=torch.int64)
    return [len(window_out), len(budget_out), len(absent)]


@torch.library.impl(LIB, "cache_plan", "CompositeExplicitAutograd")
def _cache_plan_default(active_ids, last_active, slot_of, pointer, num_used, step, window, evict_rows, missing):
    return cache_plan_reference(active_ids, last_active, slot_of, pointer, num_used, step, window, evict_rows, missing)


@torch.library.register_fake("flashllm::cache_plan")
def _cache_plan_fake(active_ids, last_active, slot_of, pointer, num_used, step, window, evict_rows, missing):
    _check_cache_plan_metadata(active_ids, last_active, slot_of, pointer, num_used, window, evict_rows, missing)
    # The three counts depend on the data: unbacked sizes (hence SymInt[] in the schema).
    ctx = torch.library.get_ctx()
    return [ctx.new_dynamic_size() for _ in range(3)]


def cache_compact(
    matrix: torch.Tensor,
    pointer: torch.Tensor,
    rows: torch.Tensor,
    *,
    num_used: int,
    bias: torch.Tensor | None = None,
    slot_of: torch.Tensor | None = None,
) -> int:
    """Swap-delete cache rows in place: the last used rows move into the holes (flashllm_ext.ops.compaction_moves).

    matrix: [C, W], contiguous; the rows move
    pointer: int64 [C], neuron id of each row; entries [new num_used, num_used) become -1
    rows: int64 [K], distinct rows < num_used to delete
    bias: [C] moved with its rows; None for none
    slot_of: int64 [N], row of each neuron (-1 when absent), kept the inverse of pointer; None for none
    Returns the new num_used (num_used - K).
    """
    return torch.ops.flashllm.cache_compact.default(matrix, pointer, bias, slot_of, num_used, rows)


def cache_plan(
    active_ids: torch.Tensor,
    last_active: torch.Tensor,
    slot_of: torch.Tensor,
    pointer: torch.Tensor,
    evict_rows: torch.Tensor,
    missing: torch.Tensor,
    *,
    num_used: int,
    step: int,
    window: int,
) -> list[int]:
    """One token's decisions of the neuron cache (flashllm_ext/flash/cache.py), in place; CPU only.

    active_ids: int64 [k], this token's active neurons (any order, repeats allowed)
    last_active: int64 [N], last step each neuron was active; set to `step` for the active ids
    slot_of: int64 [N], row of each neuron (-1 when absent); pointer: int64 [C], neuron of each row
    evict_rows: int64 [>= C], receives the rows to evict; missing: int64 [>= C], receives the ids to read
    Returns [w, b, m]: evict_rows[:w] left the `window`, evict_rows[w:w+b] are evicted early (least recently
    active first) because the window's union does not fit, missing[:m] are the distinct active ids not cached.
    Raises RuntimeError, changing nothing, when the token has more distinct active neurons than C.
    """
    return torch.ops.flashllm.cache_plan.default(
        active_ids, last_active, slot_of, pointer, num_used, step, window, evict_rows, missing
    )
