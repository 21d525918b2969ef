"""The floor of bench/bench_placement.py: the offline optimum's misses (fewest_misses) are a lower bound on a cache's."""

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from bench.bench_placement import fewest_misses


def lru_misses(sets: torch.Tensor, capacity: int) -> torch.Tensor:
    """The misses of a least-recently-used cache of `capacity` rows that starts empty (each token's set read whole)."""
    last_use = {}
    misses = torch.zeros_like(sets)
    for t, row in enumerate(sets):
        for i in row.nonzero().flatten().tolist():
            misses[t, i] = i not in last_use
            last_use[i] = t
        for i in sorted(last_use, key=last_use.get)[: max(0, len(last_use) - capacity)]:
            del last_use[i]
    return misses


def test_a_hand_worked_sequence():
    # neurons 0-3, two rows; the optimum starts with {0, 1} (first used soonest), keeps 1 and 0 over 2 (used next at
    # token 3 and never) and so reads 2 at token 1, then 3 at token 2 (evicting 2, never used again)
    sets = torch.tensor([[1, 1, 0, 0], [0, 1, 1, 0], [1, 0, 0, 1], [0, 1, 0, 0]], dtype=torch.bool)
    misses = fewest_misses(sets, 2)
    assert misses.nonzero().tolist() == [[1, 2], [2, 3]]


def test_a_cache_holding_every_neuron_reads_nothing():
    sets = torch.rand(12, 40, generator=torch.Generator().manual_seed(1)) < 0.4
    assert not fewest_misses(sets, 40).any()


@settings(max_examples=60, deadline=None)
@given(
    seed=st.integers(0, 2**31 - 1),
    tokens=st.integers(1, 12),
    n=st.integers(1, 24),
    density=st.floats(0.05, 0.9),
    capacity=st.integers(1, 24),
)
def test_never_more_misses_than_lru_and_only_neurons_of_the_set(seed, tokens, n, density, capacity):
    sets = torch.rand(tokens, n, generator=torch.Generator().manual_seed(seed)) < density
    capacity = min(capacity, n)
    misses = fewest_misses(sets, capacity)
    assert not (misses & ~sets).any()
    # the optimum starts with its capacity loaded for free: LRU's misses after its own first `capacity` reads bound it
    lru = lru_misses(sets, capacity)
    free = lru.flatten().nonzero().flatten()[:capacity]
    lru.view(-1)[free] = False
    assert int(misses.sum()) <= int(lru.sum())
