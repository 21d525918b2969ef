"""The lean decoder's generate loop: greedy or sampled (temperature, top-k, top-p, repetition penalty) next tokens,
stop tokens and stop strings, text streamed as it is decoded, prompts run in chunks.

    tokens = generate(decoder, prompt_ids, max_new_tokens=64, sampling=Sampling(temperature=0.7, top_p=0.9),
                      stop_ids={eos}, on_token=print_piece)
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Sampling:
    """How the next token is chosen from the logits. temperature 0: greedy (argmax, top_k / top_p unused).
    top_k 0 and top_p 1.0: no truncation. repetition_penalty > 1 makes tokens already in the sequence less likely
    (a positive logit divided by it, a negative one multiplied, as transformers and llama.cpp do)."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    repetition_penalty: float = 1.0
    seed: int | None = None

    def __post_init__(self):
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must lie in (0, 1], got {self.top_p}")
        if self.repetition_penalty <= 0:
            raise ValueError(f"repetition_penalty must be > 0, got {self.repetition_penalty}")


def next_token(
    logits: torch.Tensor, sampling: Sampling, history: Sequence[int] = (), generator: torch.Generator | None = None
) -> int:
    """The next token id from float32 logits [vocab], given the sequence so far (for the repetition penalty)."""
    logits = logits.float()
    if sampling.repetition_penalty != 1.0 and len(history):
        seen = torch.tensor(sorted(set(history)), dtype=torch.int64, device=logits.device)
        scores = logits[seen]
        logits = logits.clone()
        logits[seen] = torch.where(
            scores > 0, scores / sampling.repetition_penalty, scores * sampling.repetition_penalty
        )
    if sampling.temperature == 0:
        return int(logits.argmax())
    logits = logits / sampling.temperature
    if sampling.top_k:
        kth = torch.topk(logits, min(sampling.top_k, logits.numel())).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if sampling.top_p < 1.0:
        ordered, order = logits.sort(descending=True)
        cumulative = ordered.softmax(-1).cumsum(-1)
        drop = cumulative - ordered.softmax(-1) >= sampling.top_p  # keep the smallest head whose mass reaches top_p
        logits = logits.scatter(0, order[drop], float("-inf"))
    return int(torch.multinomial(logits.softmax(-1), 1, generator=generator))


def generate(
    decoder,
    prompt_ids: Sequence[int] | torch.Tensor,
    max_new_tokens: int,
    *,
    sampling: Sampling = Sampling(),
    stop_ids: Collection[int] = (),
    on_token: Callable[[int], bool | None] | None = None,
    chunk: int = 256,
) -> list[int]:
    """New token ids after the prompt, at most max_new_tokens, ending at (and including) the first of stop_ids.
    The decoder continues its sequence (reset it first for a new one). on_token(id) is called for every new token
    as soon as it is chosen; it returns True to stop there (a stop string, say). chunk: prompt tokens per forward."""
    if max_new_tokens < 0:
        raise ValueError(f"max_new_tokens must be >= 0, got {max_new_tokens}")
    prompt = torch.as_tensor(prompt_ids, dtype=torch.int64).flatten()
    if prompt.numel() == 0:
        raise ValueError("the prompt has no tokens: give at least one (a BOS token, say)")
    decoder.cache.check_room(prompt.numel() + max(0, max_new_tokens - 1))
    generator = None if sampling.seed is None else torch.Generator().manual_seed(sampling.seed)
    history, new = prompt.tolist(), []
    logits = decoder.prefill(prompt, chunk=chunk)
    for i in range(max_new_tokens):
        token = next_token(logits, sampling, history, generator)
        new.append(token)
        history.append(token)
        if (on_token is not None and on_token(token)) or token in stop_ids or i == max_new_tokens - 1:
            break
        logits = decoder.forward([token])
    return new


class TextStream:
    """Text of generated ids as it becomes final: `push(id)` returns the new text since the last call (a piece that
    ends inside a multi-byte character waits for its next token), and whether a stop string has appeared, the
    text then cut before it."""

    def __init__(self, decode: Callable[[list[int]], str], stop_strings: Collection[str] = ()):
        self.decode, self.stop_strings = decode, [s for s in stop_strings if s]
        self.ids: list[int] = []
        self.text = ""  # emitted so far

    def push(self, token: int) -> tuple[str, bool]:
        self.ids.append(token)
        text = self.decode(self.ids)
        if text.endswith("\ufffd"):  # an incomplete UTF-8 sequence: wait for the rest
            return "", False
        for stop in self.stop_strings:
            at = text.find(stop)
            if at >= 0:
                piece, self.text = text[len(self.text) : at], text[:at]
                return piece, True
        piece, self.text = text[len(self.text) :], text
        return piece, False
