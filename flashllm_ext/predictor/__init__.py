"""Activation sparsity on real models: the one active-neuron rule (`rule`), per-layer thresholds (`thresholds`),
capture of inputs and active sets (`capture`), low-rank neuron predictors (`lowrank`) and their training
(`training`), saving and loading (`io`), and evaluation (`evaluation`). The rule is documented in `rule`."""
from .capture import ActivationCapture, capture_activations
from .evaluation import SparsityCounter, evaluate, patched_ffn
from .io import load_predictors, save_predictors, save_predictors_to_store
from .lowrank import LowRankPredictor, PredictorSet
from .rule import FFNModules, activation_score, ffn_hooks, ffn_modules
from .thresholds import calibrate_thresholds
from .training import auto_rank, choose_prob_thresholds, train_predictor, train_predictors

__all__ = ["ActivationCapture", "FFNModules", "LowRankPredictor", "PredictorSet", "SparsityCounter",
           "activation_score", "auto_rank", "calibrate_thresholds", "capture_activations", "choose_prob_thresholds",
           "evaluate", "ffn_hooks", "ffn_modules", "load_predictors", "patched_ffn", "save_predictors",
           "save_predictors_to_store", "train_predictor", "train_predictors"]
