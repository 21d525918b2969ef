"""ExpertCache: a hypothesis state machine over random routing (forwards of any experts, rounds when they outnumber
the slots, naive mode's forget) checking its bookkeeping and each policy's choice of victims, and its refusals."""

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule, run_state_machine_as_test
import torch

from flashllm_ext.flash.experts import EXPERT_POLICIES, ExpertCache

N_EXPERTS = 10


class ExpertCacheMachine(RuleBasedStateMachine):
    """Forwards as ExpertFFN runs them: tick, touch the needed experts, look them up, admit the misses in rounds of
    at most `capacity`. The model: per expert its uses and the forward that last touched it."""

    @initialize(capacity=st.integers(1, N_EXPERTS), policy=st.sampled_from(EXPERT_POLICIES))
    def start(self, capacity, policy):
        self.cache = ExpertCache(N_EXPERTS, capacity, size=2, row_width=3, dtype=torch.float32, policy=policy)
        self.uses = [0] * N_EXPERTS
        self.last = [0] * N_EXPERTS

    def key(self, expert: int) -> tuple[int, ...]:
        """The policy's order of leaving: lowest first."""
        if self.cache.policy == "lfu":
            return (self.uses[expert], self.last[expert])
        return (self.last[expert],)

    @rule(experts=st.lists(st.integers(0, N_EXPERTS - 1), min_size=1, max_size=N_EXPERTS, unique=True))
    def forward(self, experts):
        cache = self.cache
        cache.tick()
        cache.touch(experts)
        for e in experts:
            self.uses[e] += 1
        held_before = set(cache.slot_of)
        hits, misses = cache.lookup(experts)
        assert {e for e, _ in hits} == held_before & set(experts)
        assert set(misses) == set(experts) - held_before
        for e in held_before & set(experts):
            self.last[e] = cache.clock
        for first in range(0, len(misses), cache.capacity):
            chunk = misses[first : first + cache.capacity]
            before = set(cache.slot_of)
            pairs = cache.admit(chunk)
            after = set(cache.slot_of)
            assert [e for e, _ in pairs] == chunk and set(chunk) <= after
            assert len({s for _, s in pairs}) == len(pairs)
            evicted, kept = before - after, before & after
            if evicted and kept:  # every victim leaves before anything the policy ranks higher
                assert max(self.key(e) for e in evicted) <= min(self.key(e) for e in kept)
            for e in chunk:
                self.last[e] = cache.clock

    @rule()
    def forget(self):
        self.cache.forget()
        assert not self.cache.slot_of

    @invariant()
    def slots_and_experts_agree(self):
        cache = self.cache
        assert len(cache.slot_of) <= cache.capacity
        for e, s in cache.slot_of.items():
            assert cache.expert_in[s] == e
        assert sum(e >= 0 for e in cache.expert_in) == len(cache.slot_of)


def test_expert_cache_state_machine():
    run_state_machine_as_test(
        ExpertCacheMachine,
        settings=settings(
            max_examples=150, stateful_step_count=30, deadline=None, suppress_health_check=list(HealthCheck)
        ),
    )


def test_refusals():
    with pytest.raises(ValueError, match="policy"):
        ExpertCache(4, 2, 2, 3, torch.float32, policy="fifo")
    with pytest.raises(ValueError, match="capacity"):
        ExpertCache(4, 0, 2, 3, torch.float32)
    cache = ExpertCache(4, 2, 2, 3, torch.float32)
    with pytest.raises(ValueError, match="at most 2"):
        cache.admit([0, 1, 2])
    cache.admit([0])
    with pytest.raises(ValueError, match="not held"):
        cache.admit([0])
