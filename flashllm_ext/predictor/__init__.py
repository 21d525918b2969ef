"""Activation sparsity on real models: the one active-neuron rule (`rule`), per-layer thresholds (`thresholds`),
capture of inputs and active sets (`capture`), the predictor interface and its registry of methods (`base`): low-rank
classifiers and regressions (`lowrank`), low-bit copies of the input projections (`quant`, rounded to nearest or by
GPTQ), the true sets (`oracle`), one set per block of tokens (`context`), input sparsity (`teal`, evaluation only);
building them (`training`), per-layer densities for a target mean (`allocation`), saving and loading (`io`), and
evaluation (`evaluation`). The rule is documented in `rule`."""

from flashllm_ext.predictor.allocation import ALLOCATIONS, allocate_densities, fisher_costs
from flashllm_ext.predictor.base import PREDICTOR_METHODS, NeuronPredictor, predictor_class
from flashllm_ext.predictor.capture import ActivationCapture, capture_activations
from flashllm_ext.predictor.context import ContextPredictor
from flashllm_ext.predictor.evaluation import SparsityCounter, evaluate, operating_point, patched_ffn
from flashllm_ext.predictor.io import load_predictors, predictors_recipe, save_predictors, save_predictors_to_store
from flashllm_ext.predictor.lowrank import LowRankPredictor, PredictorSet, RegressionPredictorSet, fit_log_regression
from flashllm_ext.predictor.oracle import OraclePredictor
from flashllm_ext.predictor.placement import PLACEMENTS, coactivation_order, frequency_order, neuron_orders
from flashllm_ext.predictor.quant import ROUNDINGS, QuantPredictor, default_group_size, quantize_rows
from flashllm_ext.predictor.rule import (
    FFNModules,
    FFNWeights,
    activation_score,
    ffn_hooks,
    ffn_modules,
    ffn_weights,
    input_weight_share,
)
from flashllm_ext.predictor.teal import TealPredictor
from flashllm_ext.predictor.thresholds import calibrate_thresholds
from flashllm_ext.predictor.training import (
    DEFAULT_DENSITY,
    DEFAULT_GATE_BITS,
    DEFAULT_GROUP_SIZE,
    DEFAULT_METHOD,
    DEFAULT_RECIPE,
    DEFAULT_ROUNDING,
    DEFAULT_UP_BITS,
    auto_rank,
    build_predictors,
    choose_prob_thresholds,
    default_rounding,
    predictors_from_capture,
    predictors_recipe_of,
    select_density,
    train_predictor,
    train_predictors,
)

__all__ = [
    "ALLOCATIONS",
    "DEFAULT_DENSITY",
    "DEFAULT_GATE_BITS",
    "DEFAULT_GROUP_SIZE",
    "DEFAULT_METHOD",
    "DEFAULT_RECIPE",
    "DEFAULT_ROUNDING",
    "DEFAULT_UP_BITS",
    "PLACEMENTS",
    "PREDICTOR_METHODS",
    "ROUNDINGS",
    "ActivationCapture",
    "ContextPredictor",
    "FFNModules",
    "FFNWeights",
    "LowRankPredictor",
    "NeuronPredictor",
    "OraclePredictor",
    "PredictorSet",
    "QuantPredictor",
    "RegressionPredictorSet",
    "SparsityCounter",
    "TealPredictor",
    "activation_score",
    "allocate_densities",
    "auto_rank",
    "build_predictors",
    "calibrate_thresholds",
    "capture_activations",
    "choose_prob_thresholds",
    "coactivation_order",
    "default_group_size",
    "default_rounding",
    "evaluate",
    "ffn_hooks",
    "ffn_modules",
    "ffn_weights",
    "fisher_costs",
    "fit_log_regression",
    "frequency_order",
    "input_weight_share",
    "load_predictors",
    "neuron_orders",
    "operating_point",
    "patched_ffn",
    "predictor_class",
    "predictors_from_capture",
    "predictors_recipe",
    "predictors_recipe_of",
    "quantize_rows",
    "save_predictors",
    "save_predictors_to_store",
    "select_density",
    "train_predictor",
    "train_predictors",
]
