"""Two neuron caches over one store stepped alike (a CPU cache and one whose rows live elsewhere) and compared bit for
bit after every step."""

import pytest
import torch

from flashllm_ext.flash.cache import NeuronCache


def assert_same_state(host: NeuronCache, dev: NeuronCache) -> None:
    """Everything a step decides and moves, equal bit for bit (the staged cache's device tensors included)."""
    assert dev.num_used == host.num_used and dev.steps == host.steps
    for name in ("pointer", "slot_of", "last_active"):
        assert torch.equal(getattr(dev, name), getattr(host, name)), name
    assert torch.equal(dev.device_pointer.cpu(), host.pointer)
    used = host.num_used
    assert torch.equal(dev.matrix[:used].cpu().view(torch.int16), host.matrix[:used].view(torch.int16))
    if host.bias is not None:
        assert torch.equal(dev.bias[:used].cpu().view(torch.int16), host.bias[:used].view(torch.int16))


def step_both(host: NeuronCache, dev: NeuronCache, ids: list[int], background: bool) -> None:
    """One token with active neurons `ids` on both caches: the same decisions and counts, the same state after (or
    the same refusal of more distinct neurons than the capacity)."""
    active = torch.tensor(ids, dtype=torch.int64)
    if len(set(ids)) > host.capacity:
        for cache in (host, dev):
            with pytest.raises(ValueError, match="distinct active neurons"):
                cache.step(active)
        assert_same_state(host, dev)
        return
    want = host.step(active)
    pending = dev.begin_step(active, background=background)
    got = pending.finish()
    for field in ("evicted", "evicted_budget", "inserted", "bytes_read", "num_used"):
        assert getattr(got, field) == getattr(want, field), field
    assert_same_state(host, dev)
