"""The `flashllm` command line: every subcommand answers a user's mistake with one line on stderr and a non-zero
status, never a traceback, before any long work; Ctrl-C exits with status 130."""

import os
import subprocess
import sys
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import GPT2Config, GPT2LMHeadModel, PreTrainedTokenizerFast

from flashllm_ext import cli
from flashllm_ext.flash.convert import convert
from flashllm_ext.offload.convert import convert_offload
from flashllm_ext.predictor import LowRankPredictor, PredictorSet, save_predictors
from tests.helpers.models import tiny_model

ROOT = Path(__file__).resolve().parent.parent
VOCAB = 64


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> dict[str, Path]:
    """Tiny inputs, good and bad: a Llama checkpoint and its flash and layer stores (VOCAB tokens), a GPT-2
    checkpoint, a tokenizer of 300 tokens, a GGUF without a tokenizer, a file that is no GGUF, an empty folder."""
    root = tmp_path_factory.mktemp("cli")
    tiny_model(
        "llama",
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        vocab_size=VOCAB,
    ).save_pretrained(root / "llama")
    GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=VOCAB)).save_pretrained(root / "gpt2")
    convert(root / "llama", root / "store", progress=False)
    convert_offload(root / "llama", root / "layers", progress=False)
    save_predictors(PredictorSet([LowRankPredictor(32, 64, 4)], torch.zeros(1)), root / "bare-predictors.st")
    vocab = {f"w{i}": i for i in range(300)}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="w0"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tokenizer, unk_token="w0").save_pretrained(root / "big-tokenizer")
    writer = gguf.GGUFWriter(str(root / "bare.gguf"), "llama")
    writer.add_block_count(1)
    writer.add_tensor("token_embd.weight", np.zeros((VOCAB, 32), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    (root / "not.gguf").write_text("not a model\n")
    (root / "file").write_text("a file\n")
    (root / "empty").mkdir()
    return {p.name.replace(".", "_").replace("-", "_"): p for p in root.iterdir()} | {"missing": root / "missing"}


# (subcommand and arguments with {name} for a path of `files`, what the message must say)
BAD_INPUTS = {
    "convert-missing-checkpoint": ("convert {missing} {missing}-out", "expected a Hugging Face"),
    "convert-not-gguf": ("convert {not_gguf} {missing}-out", "magic"),
    "convert-output-is-a-file": ("convert {llama} {file} --force", "not a directory"),
    "convert-output-exists": ("convert {llama} {file}", "exists"),
    "convert-output-is-input": ("convert {llama} {llama} --force", "the checkpoint it would be written from"),
    "convert-gpt2": ("convert {gpt2} {missing}-out", "'gpt2' is not supported"),
    "convert-empty-folder": ("convert {empty} {missing}-out", "config.json: missing"),
    "convert-endor-q4": ("convert {llama} {missing}-out --dtype q4 --endor", "Endor compression takes float bundles"),
    "convert-down-format-fp16": ("convert {llama} {missing}-out --down-format q4_0", "down_format applies to"),
    "convert-down-format-q5": ("convert {llama} {missing}-out --dtype q4 --down-format q5_0", "invalid choice"),
    "convert-placement-alone": ("convert {llama} {missing}-out --placement frequency", "go together"),
    "convert-placement-unknown": ("convert {llama} {missing}-out --placement random", "invalid choice"),
    "convert-placement-no-statistics": (
        "convert {llama} {missing}-out --placement coactivation --predictors {bare_predictors_st}",
        "carry no calibration statistics",
    ),
    "calibrate-missing-dir": ("calibrate-disk --dir {missing} --size-mib 1", "is not a directory"),
    "calibrate-size-0": ("calibrate-disk --dir {empty} --size-mib 0", "--size-mib: must be a positive integer"),
    "calibrate-size-negative": ("calibrate-disk --dir {empty} --size-mib -3", "--size-mib"),
    "train-missing-store": ("train-predictors {not_gguf} --store {missing}", "missing"),
    "train-not-gguf": ("train-predictors {not_gguf}", "magic"),
    "train-gate-bits-9": ("train-predictors {not_gguf} --gate-bits 9", "--gate-bits: invalid choice: 9"),
    "run-missing-store": ("run {missing} --tokenizer {big_tokenizer}", "bundles.safetensors"),
    "run-tokenizer-of-another-model": (
        "run {store} --tokenizer {big_tokenizer} --mode dense",
        f"300 tokens, the model {VOCAB} embeddings",
    ),
    "run-folder-without-tokenizer": ("run {store} --tokenizer {empty} --mode dense", "no tokenizer loads"),
    "run-gguf-without-tokenizer": ("run {store} --tokenizer {bare_gguf} --mode dense", "no tokenizer loads"),
    "offload-tokenizer-of-another-model": (
        "offload {layers} --tokenizer {big_tokenizer} --mode dense --budget 1GB",
        f"300 tokens, the model {VOCAB} embeddings",
    ),
    "offload-convert-gpt2": ("offload {missing}-out --convert {gpt2}", "'gpt2' is not supported"),
    "no-subcommand": ("", "required"),
}


@pytest.mark.parametrize("case", list(BAD_INPUTS))
def test_a_bad_input_is_one_line_on_stderr(files, case):
    argv, says = BAD_INPUTS[case]
    args = [part.format_map({k: str(v) for k, v in files.items()}) for part in argv.split()]
    env = {
        **os.environ,
        "PYTHONPATH": str(ROOT),
        "FLASHLLM_DISK_PROFILE": str(files["missing"]),
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
    }
    done = subprocess.run(
        [sys.executable, "-m", "flashllm_ext.cli", *args],
        capture_output=True,
        text=True,
        env=env,
        cwd=ROOT,
        timeout=120,
    )
    assert done.returncode != 0 and "Traceback" not in done.stderr, done.stderr
    # Progress bars (a model loads before its tokenizer is checked) are stderr output, not part of the error.
    lines = [line for line in done.stderr.splitlines() if line.strip() and "%|" not in line]
    assert len(lines) == 1 and says in lines[0], done.stderr
    assert lines[0].startswith(f"flashllm {args[0]}" if args else "flashllm"), done.stderr


def test_ctrl_c_is_a_short_message_and_status_130(monkeypatch, capsys):
    def interrupted(args):
        raise KeyboardInterrupt

    monkeypatch.setattr(cli.prepare, "_calibrate_disk", interrupted)
    with pytest.raises(SystemExit) as info:
        cli.main(["calibrate-disk"])
    assert info.value.code == 130 and capsys.readouterr().err == "flashllm calibrate-disk: interrupted\n"
