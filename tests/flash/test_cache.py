"""NeuronCache: a hypothesis state machine over random token sequences (window rule, budget rule, pinned neurons,
row contents, stats), no tensor allocation after construction, byte budget, bad input."""

import pytest
import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule, run_state_machine_as_test
from torch.profiler import ProfilerActivity, profile

from flashllm_ext.flash import store
from flashllm_ext.flash.convert import convert
from flashllm_ext.flash.cache import NeuronCache
from flashllm_ext.flash.reader import FlashReader, shared_reader
from tests.helpers.models import tiny_model

N_NEURONS = 136


@pytest.fixture(scope="module")
def stores(tmp_path_factory):
    """An OPT store (ReLU, fc1 bias: the cache carries bias rows) and a Llama store (GLU, no bias), fp16."""
    root = tmp_path_factory.mktemp("cache")
    opt = tiny_model("opt", seed=1, ffn_dim=N_NEURONS)
    llama = tiny_model(
        "llama", seed=None, hidden_size=32, intermediate_size=N_NEURONS, num_hidden_layers=1, vocab_size=64
    )
    out = {}
    for name, model in (("opt", opt), ("llama", llama)):
        model.save_pretrained(root / f"{name}-ckpt")
        out[name] = store.FlashStore(convert(root / f"{name}-ckpt", root / name, progress=False))
        out[name + "_state"] = {k: v.detach().clone() for k, v in model.state_dict().items()}
    return out


class CacheMachine(RuleBasedStateMachine):
    """Model: the active set of every token so far, and the pinned neurons, which never leave and take no part in
    the window and budget rules. Checked after every step against the cache."""

    def __init__(self, flash_store, capacity: int, window: int, reader, pinned: int = 0):
        super().__init__()
        self.store = flash_store
        pinned_ids = torch.randperm(N_NEURONS, generator=torch.Generator().manual_seed(pinned))[:pinned]
        self.pinned = set(pinned_ids.tolist())
        self.cache = NeuronCache(
            flash_store, flash_store.n_layers - 1, capacity, window, reader=reader, pinned_ids=pinned_ids
        )
        self.bundles = flash_store.bundle(flash_store.n_layers - 1, torch.arange(flash_store.n_neurons))
        self.history: list[set[int]] = []
        self.last: dict[int, int] = {}  # neuron -> last step active
        self.budget_pressure = False  # once the budget rule evicts, the cache may hold a subset of the union

    def union(self) -> set[int]:
        """The neurons the cache must hold: those of the window, and the pinned ones."""
        step = len(self.history)
        return {n for n, last in self.last.items() if last > step - self.cache.window} | self.pinned

    @rule(ids=st.lists(st.integers(0, N_NEURONS - 1), max_size=40))
    def step(self, ids):
        before = set(self.cache.cached_ids().tolist())
        active = set(ids) - self.pinned
        if len(active) > self.cache.step_capacity:
            snapshot = [t.clone() for t in (self.cache.matrix, self.cache.pointer, self.cache.last_active)]
            with pytest.raises(ValueError, match="distinct (active|unpinned) neurons"):
                self.cache.step(torch.tensor(ids, dtype=torch.int64))
            assert all(
                torch.equal(a, b)
                for a, b in zip(snapshot, (self.cache.matrix, self.cache.pointer, self.cache.last_active))
            )
            return
        stats = self.cache.step(torch.tensor(ids, dtype=torch.int64))
        self.history.append(active)
        step = len(self.history)
        for n in active:
            self.last[n] = step
        after = set(self.cache.cached_ids().tolist())
        # Stats add up.
        assert stats.inserted == len(active - before)
        assert stats.total_evicted == len(before - after)
        assert stats.num_used == self.cache.num_used == len(before) - stats.total_evicted + stats.inserted
        assert (stats.bytes_read >= stats.inserted * self.store.row_bytes) and (stats.inserted or not stats.bytes_read)
        # Window rule: exactly the neurons that left the window leave by it; the rest leave by the budget rule.
        left_window = {n for n in before - self.pinned if self.last[n] <= step - self.cache.window}
        assert left_window <= before - after
        assert stats.evicted == len(left_window)
        budget_evicted = before - after - left_window
        if budget_evicted:
            self.budget_pressure = True
            assert self.cache.num_used == self.cache.capacity  # never more evicted than needed
            kept_idle = [self.last[n] for n in after - active - self.pinned]
            assert not budget_evicted & active
            assert max(self.last[n] for n in budget_evicted) <= min(kept_idle, default=step)  # least recent first
        assert active <= after <= self.union()
        if not self.budget_pressure:
            assert after == self.union()

    @rule(ids=st.lists(st.integers(0, N_NEURONS - 1), max_size=40))
    def same_token_step(self, ids):
        """A second step for the last token (the engine's lookahead="prefetch": the set read ahead, then the set
        the token needs): the window stays; the last step's other neurons count as the token before's."""
        active = set(ids) - self.pinned
        if not self.history or len(active) > self.cache.step_capacity:
            return
        step = len(self.history)
        before = set(self.cache.cached_ids().tolist())
        stats = self.cache.begin_step(torch.tensor(ids, dtype=torch.int64), same_token=True).finish()
        for n in self.history[-1] - active:
            if self.last[n] == step:
                self.last[n] = step - 1
        for n in active:
            self.last[n] = step
        self.history[-1] = active
        after = set(self.cache.cached_ids().tolist())
        assert self.cache.steps == step and stats.inserted == len(active - before)
        left_window = {n for n in before - self.pinned if self.last[n] <= step - self.cache.window}
        assert left_window <= before - after and stats.evicted == len(left_window)
        budget_evicted = before - after - left_window
        if budget_evicted:
            self.budget_pressure = True
            assert not budget_evicted & active
            assert max(self.last[n] for n in budget_evicted) <= min(
                (self.last[n] for n in after - active - self.pinned), default=step
            )
        assert active <= after <= self.union()
        if not self.budget_pressure:
            assert after == self.union()

    @invariant()
    def rows_are_consistent(self):
        c = self.cache
        ids = c.cached_ids()
        assert c.num_used <= c.capacity
        assert ids.unique().numel() == ids.numel()  # no duplicates
        assert self.pinned <= set(ids.tolist())
        assert bool((c.pointer[c.num_used :] == -1).all())
        assert torch.equal(c.slot_of[ids], torch.arange(c.num_used))
        assert int((c.slot_of >= 0).sum()) == c.num_used
        assert torch.equal(c.matrix[: c.num_used].view(torch.int16), self.bundles[ids].view(torch.int16))
        if c.bias is not None:
            assert torch.equal(c.bias[: c.num_used], c._bias_all[ids])


@pytest.mark.parametrize("name", ["opt", "llama"])
@pytest.mark.parametrize(
    "capacity,window,pinned", [(N_NEURONS, 3, 0), (45, 2, 0), (30, 5, 0), (12, 1, 0), (60, 2, 25), (40, 3, 30)]
)
def test_state_machine(stores, name, capacity, window, pinned):
    flash_store = stores[name]
    reader = FlashReader(flash_store)
    run_state_machine_as_test(
        lambda: CacheMachine(flash_store, capacity, window, reader, pinned),
        settings=settings(
            max_examples=25, stateful_step_count=20, deadline=None, suppress_health_check=list(HealthCheck)
        ),
    )


def test_pinned_neurons_are_read_once_and_refuse_what_cannot_hold_them(stores):
    flash_store = stores["opt"]
    cache = NeuronCache(flash_store, 0, capacity=10, window=1, pinned_ids=torch.tensor([7, 3, 90]))
    assert (cache.n_pinned, cache.step_capacity, cache.num_used, cache.steps) == (3, 7, 3, 0)
    hot, cold = cache.partition(torch.tensor([1, 3, 5, 90]))
    assert hot.tolist() == [3, 90] and cold.tolist() == [1, 5]
    stats = cache.step(torch.tensor([3, 7, 90, 11]))  # the pinned ones are hits; only 11 is read
    assert stats.inserted == 1 and cache.num_used == 4
    with pytest.raises(ValueError, match="8 distinct unpinned neurons do not fit the 7 rows"):
        cache.step(torch.arange(20, 28))
    with pytest.raises(ValueError, match="cannot serve another"):
        cache.serve(1, None)
    for ids, match in ((torch.tensor([1, 1]), "distinct"), (torch.arange(10), "fewer than the capacity")):
        with pytest.raises(ValueError, match=match):
            NeuronCache(flash_store, 0, capacity=10, pinned_ids=ids)


def test_bias_rows_come_from_the_resident_fc1_bias(stores):
    cache = NeuronCache(stores["opt"], 1, capacity=50, window=2)
    cache.step(torch.tensor([5, 99, 7]))
    want = stores["opt_state"]["model.decoder.layers.1.fc1.bias"].half()
    assert torch.equal(cache.bias[:3], want[cache.cached_ids()])
    assert NeuronCache(stores["llama"], 0, capacity=5).bias is None


def test_serve_switches_the_layer_and_starts_empty(stores):
    """One cache serving the layers in turn (the engine's shared layout): serve(layer, bias) drops every row, the
    next step reads the whole set of that layer with its input bias, and a bias of the wrong kind is refused."""
    flash_store, state = stores["opt"], stores["opt_state"]
    cache = NeuronCache(flash_store, 0, capacity=20, window=3)
    cache.step(torch.tensor([3, 4, 5]))
    bias_1 = state["model.decoder.layers.1.fc1.bias"].half()
    cache.serve(1, bias_1)
    assert cache.num_used == 0 and bool((cache.slot_of == -1).all()) and bool((cache.pointer == -1).all())
    stats = cache.step(torch.tensor([4, 5, 9]))
    assert stats.inserted == 3 and cache.layer == 1
    ids = cache.cached_ids()
    assert torch.equal(cache.matrix[:3].view(torch.int16), flash_store.bundle(1, ids).view(torch.int16))
    assert torch.equal(cache.bias[:3], bias_1[ids])
    with pytest.raises(ValueError, match="input bias is absent"):
        cache.serve(0, None)
    with pytest.raises(ValueError, match="out of range"):
        cache.serve(flash_store.n_layers, bias_1)


def test_load_reads_a_set_into_the_first_rows_and_records_none(stores):
    """load (a shared cache's step): the set in rows [0, k) in its order with its bias rows, equal to the store's;
    nothing recorded (no slot, no row in use, no window entry), the rows a step held before dropped and counted as
    budget evictions, so a step after it reads its whole set; refused past the capacity and with pinned neurons."""
    flash_store, state = stores["opt"], stores["opt_state"]
    cache = NeuronCache(flash_store, 1, capacity=20, window=3)
    cache.step(torch.tensor([1, 2]))
    ids = torch.tensor([9, 4, 30])
    first = cache.load(ids)
    assert (first.inserted, first.evicted, first.evicted_budget, first.num_used) == (3, 0, 2, 3)
    assert first.bytes_read >= 3 * flash_store.row_bytes and first.n_reads >= 1
    assert torch.equal(cache.matrix[:3].view(torch.int16), flash_store.bundle(1, ids).view(torch.int16))
    assert torch.equal(cache.bias[:3], state["model.decoder.layers.1.fc1.bias"].half()[ids])
    assert cache.num_used == 0 and cache.cached_ids().numel() == 0 and bool((cache.slot_of == -1).all())
    assert int(cache.last_active[ids].max()) < int(cache.last_active[[1, 2]].min())  # not in the window
    second = cache.load(torch.tensor([5]))
    assert (second.evicted_budget, second.num_used, cache.num_used) == (0, 1, 0)
    assert cache.step(torch.tensor([5, 6])).inserted == 2  # 5 was read, not held
    empty = cache.load(torch.tensor([], dtype=torch.int64))
    assert (empty.inserted, empty.evicted_budget, cache.num_used) == (0, 2, 0)
    with pytest.raises(ValueError, match="do not fit"):
        cache.load(torch.arange(21))
    pinned = NeuronCache(flash_store, 1, capacity=20, pinned_ids=torch.tensor([3]))
    with pytest.raises(ValueError, match="no pinned neurons"):
        pinned.load(torch.tensor([4]))


def allocation_events(fn) -> list:
    """Tensor allocations (CPU allocator events, native code included) made while running fn()."""
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    return [(e.name, e.cpu_memory_usage) for e in prof.events() if e.cpu_memory_usage > 0]


def test_no_allocation_after_construction(stores):
    cache = NeuronCache(stores["opt"], 0, capacity=40, window=3)
    g = torch.Generator().manual_seed(0)
    tokens = [
        torch.randint(0, N_NEURONS, (int(torch.randint(1, 30, (1,), generator=g)),), generator=g) for _ in range(60)
    ]
    for ids in tokens[:10]:
        cache.step(ids)
    buffers = [t.data_ptr() for t in (cache.matrix, cache.pointer, cache.bias, cache.slot_of, cache.last_active)]
    stats = []
    assert allocation_events(lambda: stats.extend(cache.step(ids) for ids in tokens[10:])) == []
    assert sum(s.inserted for s in stats) > 0 and sum(s.evicted_budget for s in stats) > 0  # every path ran
    assert buffers == [
        t.data_ptr() for t in (cache.matrix, cache.pointer, cache.bias, cache.slot_of, cache.last_active)
    ]
    # The counter does see allocations, native ones included: this test can fail.
    assert allocation_events(lambda: torch.ones(100).sum()) != []
    assert (
        allocation_events(
            lambda: torch.ops.flashllm.sparse_ffn(torch.ones(1, 48).half(), cache.matrix, 3, None, "relu", False)
        )
        != []
    )


def test_byte_budget(stores):
    s = stores["opt"]
    fixed, per_row = NeuronCache.bytes_for(s, with_bias=True)
    budget = fixed + 20 * per_row + per_row - 1
    cache = NeuronCache(s, 0, budget_bytes=budget)
    assert cache.capacity == 20 and cache.nbytes <= budget
    measured = sum(
        t.numel() * t.element_size()
        for t in (
            cache.matrix,
            cache.pointer,
            cache.bias,
            cache.slot_of,
            cache.last_active,
            cache.pinned,
            cache._evict_rows,
            cache._missing,
            cache._row_ids,
            cache._bias_all,
        )
    )
    assert measured == cache.nbytes
    with pytest.raises(ValueError, match="cannot hold one row"):
        NeuronCache(s, 0, budget_bytes=fixed)
    assert NeuronCache(s, 0, budget_bytes=10**9).capacity == s.n_neurons


def test_caches_of_a_store_share_its_reader(stores):
    s = stores["opt"]
    caches = [NeuronCache(s, layer, capacity=8) for layer in range(s.n_layers)] + [NeuronCache(s, 0, capacity=8)]
    assert all(c.reader is shared_reader(s) for c in caches)
    own = FlashReader(s, threads=2)
    assert NeuronCache(s, 0, capacity=8, reader=own).reader is own


def test_bad_input(stores):
    s = stores["opt"]
    cache = NeuronCache(s, 0, capacity=10, window=2)
    cache.step(torch.tensor([1, 2]))
    snapshot = [t.clone() for t in (cache.matrix, cache.pointer, cache.slot_of, cache.last_active)]
    for ids, match in (
        (torch.tensor([1, N_NEURONS]), "outside"),
        (torch.tensor([-1]), "outside"),
        (torch.tensor(list(range(11))), "11 distinct active neurons but the cache holds 10"),
        (torch.tensor([1.0]), "1-D int64"),
        (torch.tensor([[1]]), "1-D int64"),
        ([1, 2], "1-D int64"),
    ):
        with pytest.raises(ValueError, match=match):
            cache.step(ids)
    assert all(
        torch.equal(a, b) for a, b in zip(snapshot, (cache.matrix, cache.pointer, cache.slot_of, cache.last_active))
    )
    assert cache.steps == 1
    with pytest.raises(ValueError, match="exactly one of capacity and budget_bytes"):
        NeuronCache(s, 0)
    with pytest.raises(ValueError, match="capacity must be in"):
        NeuronCache(s, 0, capacity=N_NEURONS + 1)
    with pytest.raises(ValueError, match="layer 2 out of range"):
        NeuronCache(s, 2, capacity=4)
    with pytest.raises(ValueError, match="window must be"):
        NeuronCache(s, 0, capacity=4, window=0)


def test_failed_read_leaves_a_consistent_cache(stores, monkeypatch):
    cache = NeuronCache(stores["opt"], 0, capacity=50, window=1)
    cache.step(torch.tensor([1, 2, 3]))

    def failing_read(*args, **kwargs):
        raise OSError("injected read failure")

    # The reader is the store's shared one: monkeypatch restores it for the other tests even if this one fails.
    monkeypatch.setattr(cache.reader, "read", failing_read)
    with pytest.raises(OSError, match="injected"):
        cache.step(torch.tensor([3, 40, 41]))  # window 1: 1 and 2 are evicted, 40 and 41 must be read
    cached = cache.cached_ids()
    assert set(cached.tolist()) == {3}  # the neurons whose bundles never arrived are not claimed
    assert torch.equal(cache.matrix[: cache.num_used], stores["opt"].bundle(0, cached))
    monkeypatch.undo()
    cache.step(torch.tensor([3, 40, 41]))  # the next step loads what the failed one could not
    assert sorted(cache.cached_ids().tolist()) == [3, 40, 41]
    assert torch.equal(cache.matrix[: cache.num_used], stores["opt"].bundle(0, cache.cached_ids()))
