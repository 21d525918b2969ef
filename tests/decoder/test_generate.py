"""The lean decoder's generate loop (flashllm_ext.decoder.generate): greedy and sampled choices, stop tokens and
stop strings, streamed text that never splits a character, and bad settings refused."""

import pytest
import torch

from flashllm_ext.decoder import load_decoder
from flashllm_ext.decoder.generate import Sampling, TextStream, generate, next_token
from flashllm_ext.flash.convert import convert
from tests.helpers.models import tiny_model


@pytest.fixture(scope="module")
def decoder(tmp_path_factory):
    root = tmp_path_factory.mktemp("generate")
    tiny_model("llama").save_pretrained(root / "hf")
    return load_decoder(convert(root / "hf", root / "store", dtype="fp32", progress=False), None, mode="dense")


def test_greedy_generate_is_the_argmax_chain_and_stops_where_asked(decoder):
    prompt = [5, 9, 2, 40]
    decoder.reset()
    tokens = generate(decoder, prompt, 10)
    assert decoder.length == len(prompt) + 10 - 1  # the last token is never forwarded
    decoder.reset()
    logits, want = decoder.prefill(prompt), []
    for _ in range(10):
        want.append(int(logits.argmax()))
        logits = decoder.forward([want[-1]])
    assert tokens == want
    decoder.reset()
    assert generate(decoder, prompt, 10, stop_ids={want[3]}) == want[: want.index(want[3]) + 1]
    decoder.reset()
    seen = []
    assert generate(decoder, prompt, 10, on_token=lambda t: seen.append(t) or len(seen) == 2) == want[:2] == seen


def test_sampling_is_seeded_and_its_truncations_narrow_to_greedy(decoder):
    logits = torch.randn(128, generator=torch.Generator().manual_seed(0))
    greedy = int(logits.argmax())
    draws = {
        next_token(logits, Sampling(temperature=1.0, seed=s), generator=torch.Generator().manual_seed(s))
        for s in range(20)
    }
    assert len(draws) > 1
    g = torch.Generator()
    assert next_token(logits, Sampling(temperature=5.0, top_k=1), generator=g.manual_seed(1)) == greedy
    assert next_token(logits, Sampling(temperature=5.0, top_p=1e-6), generator=g.manual_seed(1)) == greedy
    decoder.reset()
    a = generate(decoder, [5, 9], 8, sampling=Sampling(temperature=1.0, seed=3))
    decoder.reset()
    assert generate(decoder, [5, 9], 8, sampling=Sampling(temperature=1.0, seed=3)) == a


def test_repetition_penalty_lowers_tokens_already_seen():
    logits = torch.tensor([2.0, 1.9, -1.0, -1.1])
    assert next_token(logits, Sampling(repetition_penalty=1.5), history=[0]) == 1
    assert next_token(logits, Sampling(repetition_penalty=1.0), history=[0]) == 0
    logits = torch.tensor([-1.0, -1.1, -5.0])  # a negative score is multiplied: further down
    assert next_token(logits, Sampling(repetition_penalty=1.5), history=[0]) == 1


@pytest.mark.parametrize(
    "kwargs, says",
    [
        (dict(temperature=-1.0), "temperature"),
        (dict(top_k=-1), "top_k"),
        (dict(top_p=0.0), "top_p"),
        (dict(repetition_penalty=0.0), "repetition_penalty"),
    ],
)
def test_bad_sampling_settings_are_refused(kwargs, says):
    with pytest.raises(ValueError, match=says):
        Sampling(**kwargs)


def test_an_empty_prompt_and_a_prompt_past_the_cache_are_refused(decoder):
    decoder.reset()
    with pytest.raises(ValueError, match="no tokens"):
        generate(decoder, [], 4)
    with pytest.raises(ValueError, match="no room"):
        generate(decoder, [1] * 2000, 100)


def test_text_stream_waits_for_whole_characters_and_cuts_at_a_stop_string():
    pieces = {1: "caf".encode(), 2: b"\xc3", 3: b"\xa9 ok", 4: b" STOP", 5: b" more"}

    def decode(ids):
        return b"".join(pieces[i] for i in ids).decode("utf-8", errors="replace")

    stream = TextStream(decode, ["STOP"])
    assert stream.push(1) == ("caf", False)
    assert stream.push(2) == ("", False)  # half of "é"
    assert stream.push(3) == ("é ok", False)
    assert stream.push(4) == (" ", True)
    assert stream.text == "café ok "
