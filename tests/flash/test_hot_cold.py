"""The hot-cold split's cost model (flashllm_ext.flash.hot_cold): what it pins for skewed, flat and empty
statistics, and the hot set it names."""

import pytest
import torch

from flashllm_ext.flash import hot_cold
from flashllm_ext.flash.hot_cold import hot_count, hot_ids

ROW = 8192  # bytes of a bundle: at the default profile a read of one costs ~40 us of bandwidth beside 100 us latency


@pytest.fixture(autouse=True)
def no_disk_profile(monkeypatch):
    """The cost model's own defaults, whatever disk profile this machine has calibrated."""
    monkeypatch.setattr(hot_cold, "load_disk_profile", lambda: None)


def test_skewed_statistics_pin_the_frequent_neurons():
    """100 neurons in nearly every token, 900 in few: with 300 rows every frequent one is pinned (a cold set of ~45
    a token is left, against ~140 without a hot set), and enough rows stay cold to hold a token's cold set."""
    frequency = torch.cat([torch.full((100,), 0.95), torch.full((900,), 0.05)])[torch.randperm(1000)]
    count = hot_count(frequency, 300, ROW, window=5)
    cold_set = 0.05 * (1000 - count) + 3 * (0.05 * 0.95 * (1000 - count)) ** 0.5
    assert 100 <= count and 300 - count >= cold_set
    assert int((frequency[hot_ids(frequency, count)] == 0.95).sum()) == 100


def test_every_neuron_always_active_trades_pinned_bytes_for_parts():
    """Exact mode's statistics (every neuron in every token): each pinned row is a neuron not read, but the rows
    left read the rest in more parts; the split lies strictly between the extremes."""
    assert 0 < hot_count(torch.ones(1000), 250, ROW, window=5) < 249


def test_nothing_active_pins_nothing_and_bad_rows_are_refused():
    assert hot_count(torch.zeros(64), 16, ROW, window=5) == 0
    with pytest.raises(ValueError, match="at least one row"):
        hot_count(torch.ones(64), 0, ROW, window=5)


def test_the_reads_costed_are_the_plans():
    """Equal frequencies (ties pin the lower ids first) and a plan under which a read of any of the first 100 rows
    costs a gigabyte and every other read nothing: only pinning all of them avoids the cost, so the split does;
    under a plan of free reads nothing is worth pinning."""
    frequency = torch.full((1000,), 0.5)

    def first_rows_cost(ids: torch.Tensor) -> torch.Tensor:
        costly = ids[ids < 100]
        return torch.stack([costly * ROW, torch.full_like(costly, 1 << 30)], dim=1)

    calls = []

    def recorded(ids: torch.Tensor) -> torch.Tensor:
        calls.append(ids)
        return first_rows_cost(ids)

    count = hot_count(frequency, 800, ROW, window=5, plan=recorded)
    assert count >= 100
    assert hot_count(frequency, 800, ROW, window=5, plan=lambda ids: torch.zeros(0, 2, dtype=torch.int64)) == 0
    assert all(bool((ids[1:] > ids[:-1]).all()) for ids in calls)  # distinct rows, sorted, as the reader takes them
    assert hot_count(frequency, 800, ROW, window=5, plan=first_rows_cost) == count  # the same draws every call


def test_hot_ids_are_the_most_frequent_ties_by_lower_id():
    frequency = torch.tensor([0.1, 0.9, 0.5, 0.9, 0.5, 0.0])
    assert hot_ids(frequency, 3).tolist() == [1, 2, 3]
    assert hot_ids(frequency, 0).tolist() == []
