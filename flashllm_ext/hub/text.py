"""Real English text available offline (CPython's pydoc topics) and perplexity over fixed windows.

The split is by document: the distinct topic texts, in sorted topic-name order (some topics share one text,
e.g. "if" and "else"), go every HELDOUT_EVERY-th to the held-out part and otherwise to calibration, so the
two parts never share a document. The text depends on the CPython version (3.11 here).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from tqdm.auto import tqdm

PARTS = ("calibration", "heldout")
HELDOUT_EVERY = 5


def corpus_text(part: str) -> str:
    """The calibration or held-out text: its topics joined in sorted-name order."""
    from pydoc_data.topics import topics

    if part not in PARTS:
        raise ValueError(f"part must be one of {PARTS}, got {part!r}")
    documents = list(dict.fromkeys(topics[name] for name in sorted(topics)))
    want_heldout = part == "heldout"
    return "\n\n".join(doc for i, doc in enumerate(documents) if (i % HELDOUT_EVERY == 0) == want_heldout)


def corpus_token_ids(tokenizer, part: str, max_tokens: int | None = None) -> torch.Tensor:
    """Token ids (int64 [T], no special tokens) of the calibration or held-out text, truncated to max_tokens."""
    ids = tokenizer(corpus_text(part), add_special_tokens=False, return_tensors="pt").input_ids[0]
    return ids if max_tokens is None else ids[:max_tokens]


def spread_windows(token_ids: torch.Tensor, n_windows: int, window: int) -> torch.Tensor:
    """n_windows windows of `window` tokens spread evenly over token_ids [T], concatenated: [n_windows * window].

    Calibrating on windows from the whole text rather than its first pages covers more topics, so thresholds
    carry over to held-out text.
    """
    if token_ids.dim() != 1 or n_windows < 1 or window < 1 or token_ids.numel() < n_windows * window:
        raise ValueError(
            f"cannot take {n_windows} windows of {window} tokens from token ids of shape {tuple(token_ids.shape)}"
        )
    starts = torch.linspace(0, token_ids.numel() - window, n_windows).long()
    return torch.cat([token_ids[s : s + window] for s in starts.tolist()])


@torch.inference_mode()
def perplexity(
    model: torch.nn.Module, token_ids: torch.Tensor, window: int = 512, n_windows: int = 4, progress: bool = True
) -> float:
    """exp(mean next-token NLL) over the first `n_windows` non-overlapping windows of `window` tokens.

    token_ids: int64 [T] with T >= window * n_windows. Each window is scored independently (no carried context),
    so every window contributes window - 1 predictions.
    """
    if token_ids.dim() != 1 or window < 2 or n_windows < 1:
        raise ValueError(
            f"need 1-D token ids, window >= 2, n_windows >= 1; got shape {tuple(token_ids.shape)}, "
            f"window={window}, n_windows={n_windows}"
        )
    if token_ids.numel() < window * n_windows:
        raise ValueError(
            f"{n_windows} windows of {window} tokens need {window * n_windows} tokens, got {token_ids.numel()}"
        )
    total_nll, count = 0.0, 0
    windows = token_ids[: window * n_windows].view(n_windows, window)
    for ids in tqdm(windows, desc="perplexity", disable=not progress, leave=False):
        logits = model(ids.unsqueeze(0)).logits[0, :-1].float()
        total_nll += F.cross_entropy(logits, ids[1:], reduction="sum").item()
        count += window - 1
    return math.exp(total_nll / count)
