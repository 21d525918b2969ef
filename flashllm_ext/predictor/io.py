"""Saving and loading a PredictorSet: a standalone safetensors file, or the `predictor.*` tensors of a flash store's
resident file (with the `predictors` metadata entry), so a store carries the predictors of its model."""
from __future__ import annotations

import json
import os
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from ..errors import FormatError
from ..store import RESIDENT_FILE, FlashStore
from .lowrank import LowRankPredictor, PredictorSet

FORMAT_NAME = "flashllm-predictors"
FORMAT_VERSION = "3"  # 3: predictors see the FFN's normalised input; the score is |h|
TENSOR_PREFIX = "predictor."


def _tensors_and_metadata(predictors: PredictorSet) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    tensors = {f"{TENSOR_PREFIX}{k}": v.detach().contiguous() for k, v in predictors.state_dict().items()}
    first = predictors.predictors[0]
    meta = {"ranks": [p.rank for p in predictors.predictors], "d": first.down.in_features,
            "n_neurons": first.up.out_features, "top_k": predictors.top_k}
    return tensors, {"predictors": json.dumps(meta), "predictors_version": FORMAT_VERSION}


def save_predictors(predictors: PredictorSet, path: str | os.PathLike) -> None:
    """Write a standalone predictors file (safetensors)."""
    tensors, meta = _tensors_and_metadata(predictors)
    save_file(tensors, os.fspath(path), metadata={"format": FORMAT_NAME, "version": FORMAT_VERSION, **meta})


def save_predictors_to_store(predictors: PredictorSet, store_dir: str | os.PathLike) -> Path:
    """Add (or replace) the predictors in a flash store's resident file: tensors `predictor.*` and the
    `predictors` metadata entry; everything else in the file is kept. Atomic (temp file + rename)."""
    with FlashStore(store_dir) as store:  # validates the store before touching it
        dims = (store.n_layers, store.hidden_size, store.n_neurons)
    first = predictors.predictors[0]
    shape = (len(predictors.predictors), first.down.in_features, first.up.out_features)
    if shape != dims:
        raise ValueError(f"{store_dir}: store has (layers, hidden, neurons) = {dims}, predictors {shape}")
    path = Path(store_dir) / RESIDENT_FILE
    with safe_open(path, "pt") as f:
        metadata = dict(f.metadata() or {})
        kept = {k: f.get_tensor(k) for k in f.keys() if not k.startswith(TENSOR_PREFIX)}
    tensors, meta = _tensors_and_metadata(predictors)
    partial = path.with_name(path.name + ".partial")
    save_file({**kept, **tensors}, str(partial), metadata={**metadata, **meta})
    os.replace(partial, path)
    return path


def load_predictors(path: str | os.PathLike) -> PredictorSet:
    """Read a file written by `save_predictors`, or a store directory written by `save_predictors_to_store`;
    FormatError if malformed."""
    path = Path(path)
    if path.is_dir():
        path = path / RESIDENT_FILE
    path = os.fspath(path)
    try:
        with safe_open(path, "pt") as f:  # only the predictor tensors: a store's resident file holds the model too
            metadata = f.metadata() or {}
            tensors = {k: f.get_tensor(k) for k in f.keys() if k.startswith(TENSOR_PREFIX)}
    except (SafetensorError, OSError) as e:
        raise FormatError("header", str(e), path) from e
    standalone = metadata.get("format") == FORMAT_NAME and metadata.get("version") == FORMAT_VERSION
    if not standalone and metadata.get("predictors_version") != FORMAT_VERSION:
        raise FormatError("__metadata__.format", f"expected {FORMAT_NAME} v{FORMAT_VERSION} or a store with "
                          f"predictors, got {metadata.get('format')!r} v{metadata.get('version')!r}", path)
    try:
        meta = json.loads(metadata["predictors"])
        ranks, d, n = [int(r) for r in meta["ranks"]], int(meta["d"]), int(meta["n_neurons"])
        top_k = meta["top_k"]
    except (KeyError, TypeError, ValueError) as e:
        raise FormatError("__metadata__.predictors", f"bad value ({e!r})", path) from None
    state = {k.removeprefix(TENSOR_PREFIX): v for k, v in tensors.items() if k.startswith(TENSOR_PREFIX)}
    for key in ("thresholds", "prob_thresholds"):
        if key not in state:
            raise FormatError(f"predictor.{key}", "missing", path)
    out = PredictorSet([LowRankPredictor(d, n, r) for r in ranks], state["thresholds"], state["prob_thresholds"],
                       top_k)
    try:
        out.load_state_dict(state)
    except RuntimeError as e:
        raise FormatError("predictor.*", f"tensors disagree with the metadata: {' '.join(str(e).split())}"[:600],
                          path) from None
    return out.eval()
