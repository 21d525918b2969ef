"""Saving and loading neuron predictors of any method: a standalone safetensors file, or the `predictor.*` tensors
of a flash store's resident file (with the `predictors` metadata entry), so a store carries the predictors of its
model. The metadata is the predictor's `config()` (its method and shapes); loading rebuilds that method's class
and refuses tensors that disagree with it."""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from flashllm_ext.errors import FormatError
from flashllm_ext.io.paths import regular_file
from flashllm_ext.io.safetensors import save_tensors
from flashllm_ext.flash.store import RESIDENT_FILE, FlashStore
from flashllm_ext.predictor.base import NeuronPredictor, predictor_class

FORMAT_NAME = "flashllm-predictors"
FORMAT_VERSION = "4"  # 4: any method, its config() in the metadata; 3: low-rank only, the score |h|
TENSOR_PREFIX = "predictor."
RECIPE_KEY = "predictors_recipe"


def _tensors_and_metadata(predictors: NeuronPredictor) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    tensors = {f"{TENSOR_PREFIX}{k}": v.detach().contiguous() for k, v in predictors.state_dict().items()}
    return tensors, {"predictors": json.dumps(predictors.config()), "predictors_version": FORMAT_VERSION}


def save_predictors(predictors: NeuronPredictor, path: str | os.PathLike) -> None:
    """Write a standalone predictors file (safetensors)."""
    tensors, meta = _tensors_and_metadata(predictors)
    save_tensors(tensors, path, {"format": FORMAT_NAME, "version": FORMAT_VERSION, **meta})


def save_predictors_to_store(
    predictors: NeuronPredictor, store_dir: str | os.PathLike, recipe: dict | None = None
) -> Path:
    """Add (or replace) the predictors in a flash store's resident file: tensors `predictor.*` and the
    `predictors` metadata entry; everything else in the file is kept. Atomic (temp file + rename). ValueError if
    they were made for a model of other shapes. recipe: how they were built (e.g. training.DEFAULT_RECIPE), kept in
    the `predictors_recipe` entry (None: no entry) so a cache can tell whether they are the ones it wants
    (`predictors_recipe`)."""
    with FlashStore(store_dir) as store:  # validates the store before touching it
        predictors.check_shape(store.n_layers, store.hidden_size, store.n_neurons, f"the store {store_dir}")
    path = Path(store_dir) / RESIDENT_FILE
    with safe_open(path, "pt") as f:
        metadata = dict(f.metadata() or {})
        kept = {k: f.get_tensor(k) for k in f.keys() if not k.startswith(TENSOR_PREFIX)}
    metadata.pop(RECIPE_KEY, None)  # the old predictors' recipe leaves with them
    tensors, meta = _tensors_and_metadata(predictors)
    if recipe is not None:
        meta[RECIPE_KEY] = json.dumps(recipe, sort_keys=True)
    partial = path.with_name(path.name + ".partial")
    save_tensors({**kept, **tensors}, partial, {**metadata, **meta})
    os.replace(partial, path)
    return path


def predictors_recipe(store_dir: str | os.PathLike) -> dict | None:
    """The recipe saved with a store's predictors (save_predictors_to_store), or None: no store, no predictors,
    or predictors saved without one."""
    try:
        with safe_open(regular_file(Path(store_dir) / RESIDENT_FILE), "pt") as f:
            text = (f.metadata() or {}).get(RECIPE_KEY)
        return None if text is None else json.loads(text)
    except (SafetensorError, OSError, json.JSONDecodeError):
        return None


def load_predictors(path: str | os.PathLike) -> NeuronPredictor:
    """Read a file written by `save_predictors`, or a store directory written by `save_predictors_to_store`;
    FormatError if malformed, of another format version, or its tensors disagree with its metadata."""
    path = Path(path)
    if path.is_dir():
        path = path / RESIDENT_FILE
    path = os.fspath(path)
    try:
        # only the predictor tensors: a store's resident file holds the model too
        with safe_open(regular_file(path), "pt") as f:
            metadata = f.metadata() or {}
            tensors = {k: f.get_tensor(k) for k in f.keys() if k.startswith(TENSOR_PREFIX)}
    except (SafetensorError, OSError) as e:
        raise FormatError("header", str(e), path) from e
    standalone = metadata.get("format") == FORMAT_NAME and metadata.get("version") == FORMAT_VERSION
    if not standalone and metadata.get("predictors_version") != FORMAT_VERSION:
        found = metadata.get("version") if metadata.get("format") == FORMAT_NAME else metadata.get("predictors_version")
        raise FormatError(
            "__metadata__.format",
            f"expected {FORMAT_NAME} v{FORMAT_VERSION} or a store with "
            f"predictors v{FORMAT_VERSION}, got v{found!r} (older predictors: train them again)",
            path,
        )
    try:
        config = json.loads(metadata["predictors"])
        out = predictor_class(config["method"]).from_config(config)
        density = config.get("loaded_density")  # (predictors saved before it was kept: unknown)
        out.loaded_density = None if density is None else float(density)
    except (KeyError, TypeError, ValueError) as e:
        raise FormatError("__metadata__.predictors", f"bad value ({e!r})", path) from None
    state = {k.removeprefix(TENSOR_PREFIX): v for k, v in tensors.items()}
    # (predictors saved before their calibration statistics were kept: unknown, zeros)
    for key, value in out.state_dict().items():
        if key.split(".")[-1] in ("frequency", "neuron_order"):
            state.setdefault(key, value)
    try:
        out.load_state_dict(state)
    except RuntimeError as e:
        raise FormatError(
            "predictor.*", f"tensors disagree with the metadata: {' '.join(str(e).split())}"[:600], path
        ) from None
    return out.eval()
