"""llama.cpp (`llama-cpp-python`, weights memory-mapped) as a measured peer of the engine (docs/design.md §8).

`ensure_env()` builds llama-cpp-python from source once into a cached virtual environment of its own (it must not
meet torch or this package); `run_llama_cpp(gguf, prompt_ids, n_tokens, threads)` runs `llama_cpp_worker.py` with
that environment's python, optionally inside a memory cgroup, and returns its measurements as a row;
`write_f16_gguf(src, dst)` writes a GGUF's weights dequantized to F16, the weights the fp16 store holds;
`write_llama_gguf(checkpoint_dir, dst, tokenizer_gguf)` writes a Hugging Face Llama checkpoint (synthesized 7B shapes
included) as llama.cpp's F16 GGUF, with the tokenizer of another GGUF.
`python -m flashllm_ext.harness.llama_cpp --build` (`make llama-cpp`) builds the environment.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

from flashllm_ext.harness.cgroup import run_limited_child
from flashllm_ext.io.paths import resolve_cache_dir, staged_file

LLAMA_CPP_VERSION = "0.3.36"
# A CPU build for this machine's ISA. mtmd (multimodal, "llava") is imported lazily by llama-cpp-python and never
# by the worker: leaving it out halves the build.
CMAKE_ARGS = "-DGGML_NATIVE=ON -DLLAVA_BUILD=OFF"
ENV_VARIABLE = "FLASHLLM_LLAMA_CPP_ENV"
WORKER = Path(__file__).with_name("llama_cpp_worker.py")
_STAMP = "flashllm-build.json"
_BUILD_LOG = "build.log"
# 16 tokens for the default model's tokenizer.
DEFAULT_PROMPT = "The three most important things to remember when you first learn to cook at home are"
_NINJA_STEP = re.compile(r"^\s*\[(\d+)/(\d+)\]")


def env_dir() -> Path:
    """The virtual environment's folder: $FLASHLLM_LLAMA_CPP_ENV, else <cache>/llama-cpp/venv."""
    override = os.environ.get(ENV_VARIABLE)
    return Path(override) if override else resolve_cache_dir() / "llama-cpp" / "venv"


def env_python(env: Path | None = None) -> Path:
    return (env or env_dir()) / "bin" / "python"


def _wanted_stamp(cmake_args: str) -> dict:
    return {"llama_cpp_python": LLAMA_CPP_VERSION, "cmake_args": cmake_args}


def env_ready(env: Path | None = None, cmake_args: str = CMAKE_ARGS) -> bool:
    """Whether `env` holds a finished build of LLAMA_CPP_VERSION with `cmake_args`."""
    env = env or env_dir()
    try:
        stamp = json.loads((env / _STAMP).read_text())
    except (OSError, ValueError):
        return False
    return stamp == _wanted_stamp(cmake_args) and env_python(env).is_file()


def ensure_env(env: Path | None = None, *, cmake_args: str = CMAKE_ARGS) -> Path:
    """The folder of a virtual environment holding llama-cpp-python LLAMA_CPP_VERSION built from source with
    `cmake_args`; built on the first call (minutes: llama.cpp compiles on every core), reused after. A stamp file
    records the version and the CMake arguments: a change of either rebuilds from an empty environment.

    Raises RuntimeError naming the build log when the build fails, FileExistsError when `env` is a folder of other
    files (it is emptied before a build)."""
    env = env or env_dir()
    if env_ready(env, cmake_args):
        return env
    if env.is_dir() and any(env.iterdir()) and not (env / "pyvenv.cfg").is_file():
        raise FileExistsError(f"{env} holds files but no virtual environment: not replacing it")
    env.parent.mkdir(parents=True, exist_ok=True)
    print(f"llama-cpp-python {LLAMA_CPP_VERSION}: creating {env}", flush=True)
    subprocess.run([sys.executable, "-m", "venv", "--clear", str(env)], check=True)
    log_path = env / _BUILD_LOG
    command = [
        str(env_python(env)),
        *("-m", "pip", "install", "-v", "--no-binary", "llama-cpp-python"),
        f"llama-cpp-python=={LLAMA_CPP_VERSION}",
    ]
    jobs = os.environ.get("MAX_JOBS") or str(os.cpu_count() or 1)
    build_env = {**os.environ, "CMAKE_ARGS": cmake_args, "CMAKE_BUILD_PARALLEL_LEVEL": jobs}
    print(f"llama-cpp-python {LLAMA_CPP_VERSION}: building from source (CMAKE_ARGS={cmake_args!r}), log: {log_path}")
    with open(log_path, "w") as log:
        proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=build_env)
        shown = -1
        for line in proc.stdout:
            log.write(line)
            step = _NINJA_STEP.match(line)
            if step:  # one line per tenth of the compile steps, not one per object file
                tenth = 10 * int(step[1]) // int(step[2])
                if tenth > shown:
                    shown = tenth
                    print(f"  compiled {step[1]}/{step[2]}", flush=True)
        status = proc.wait()
    if status != 0:
        raise RuntimeError(
            f"building llama-cpp-python {LLAMA_CPP_VERSION} failed (pip exited with {status}); see {log_path}"
        )
    (env / _STAMP).write_text(json.dumps(_wanted_stamp(cmake_args)))
    print(f"llama-cpp-python {LLAMA_CPP_VERSION}: ready in {env}", flush=True)
    return env


def baseline_bytes(env: Path | None = None) -> int:
    """The resident memory of the worker right after `import llama_cpp`, in bytes: the baseline a memory budget is
    added to (docs/design.md §8)."""
    argv = [str(env_python(env or ensure_env())), "-I", str(WORKER), "--baseline"]
    out = subprocess.run(argv, capture_output=True, text=True, check=True, timeout=120).stdout
    return json.loads(out.splitlines()[-1])["rss_baseline_bytes"]


def run_llama_cpp(
    gguf: str | os.PathLike,
    prompt_ids: Sequence[int] | str,
    n_tokens: int,
    threads: int,
    *,
    n_ctx: int = 512,
    use_mmap: bool = True,
    repack: bool = False,
    memory_limit_bytes: int | None = None,
    timeout: float = 1800,
    env: Path | None = None,
) -> dict:
    """Greedy decoding by llama.cpp in a process of its own: a prefill of `prompt_ids` (token ids, or text its
    tokenizer encodes), then `n_tokens` timed decode steps on `threads` threads. The row of llama_cpp_worker.py:
    ms_per_token (median) and mean_ms_per_token, prefill_tok_s, generated (n_tokens + 1 ids, the first from the
    prefill), proc_read_mb_per_token (storage reads over the decode), rss_baseline_mb (after `import llama_cpp`),
    RSS after load, buffers_mib (llama.cpp's buffers by type).

    repack=False (llama.cpp's --no-repack) keeps the weights memory-mapped; llama.cpp's default copies them into
    anonymous memory on CPUs with extra buffer types, for the types it repacks (on x86 Q4_0, Q8_0, the K-quants,
    IQ4_NL; not Q4_1 or F16). With `memory_limit_bytes` the process runs in a fresh memory
    cgroup of that limit after the page cache is dropped, and the row adds cgroup_peak_mb, oom_killed and the other
    facts of harness.cgroup.run_limited_child; a process that fails (OOM-killed, timed out) gives a row with `error`
    rather than an exception."""
    argv = [str(env_python(env or ensure_env())), "-I", str(WORKER), "--model", os.fspath(gguf)]
    if isinstance(prompt_ids, str):
        argv += ["--prompt-text", prompt_ids]
    else:
        argv += ["--prompt-ids", ",".join(str(int(t)) for t in prompt_ids)]
    argv += ["--tokens", str(n_tokens), "--threads", str(threads), "--n-ctx", str(n_ctx)]
    argv += [] if use_mmap else ["--no-mmap"]
    argv += ["--repack"] if repack else []
    if memory_limit_bytes is None:
        rows, facts = _run_plain(argv, timeout)
    else:
        rows, facts = run_limited_child(argv, memory_limit_bytes, 0, "llama-cpp", timeout)
    return {**(rows[-1] if rows else {"error": "the worker printed no row"}), **facts}


def _run_plain(argv: list[str], timeout: float) -> tuple[list[dict], dict]:
    try:
        proc = subprocess.run(argv, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return [{"error": f"timed out after {timeout:g} s (killed)"}], {"exit_status": -9}
    rows = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    if proc.returncode != 0 and not rows:
        rows = [{"error": f"worker exited with status {proc.returncode}: {proc.stderr.strip()[-400:]}"}]
    return rows, {"exit_status": proc.returncode}


def _copy_field(writer, field) -> None:
    """A GGUF reader's KV field into `writer`, with its value type (and its elements' type for an array)."""
    import gguf

    sub_type = field.types[1] if field.types[0] == gguf.GGUFValueType.ARRAY else None
    writer.add_key_value(field.name, field.contents(), field.types[0], sub_type=sub_type)


def write_f16_gguf(src: str | os.PathLike, dst: str | os.PathLike) -> Path:
    """A copy of the GGUF `src` at `dst` with every KV field (architecture, hyperparameters, tokenizer, chat
    template) and every tensor dequantized: 2-D and larger as F16, 1-D (norms) as F32, as llama.cpp's converter
    writes them. These are the weights an fp16 store of `src` holds. Kept when `dst` is newer than `src`.

    Tensors are dequantized and written one at a time: memory stays at one tensor, whatever the model's size."""
    import gguf
    import numpy as np

    src, dst = Path(src), Path(dst)
    if dst.is_file() and dst.stat().st_mtime > src.stat().st_mtime:
        return dst
    reader = gguf.GGUFReader(src)
    with staged_file(dst) as tmp:
        writer = gguf.GGUFWriter(tmp, reader.fields["general.architecture"].contents())
        for field in reader.fields.values():
            name = field.name
            if name.startswith("GGUF.") or name == "general.architecture":  # the writer writes these itself
                continue
            if name == "general.alignment":
                writer.add_custom_alignment(field.contents())
            elif name == "general.file_type":
                writer.add_file_type(gguf.LlamaFileType.MOSTLY_F16)
            else:
                _copy_field(writer, field)
        if "general.file_type" not in reader.fields:
            writer.add_file_type(gguf.LlamaFileType.MOSTLY_F16)
        dtypes = [np.float32 if len(t.shape) == 1 else np.float16 for t in reader.tensors]
        for tensor, dtype in zip(reader.tensors, dtypes):
            shape = [int(n) for n in reversed(tensor.shape)]
            writer.add_tensor_info(
                tensor.name, shape, np.dtype(dtype), int(tensor.n_elements) * np.dtype(dtype).itemsize
            )
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_ti_data_to_file()
        for tensor, dtype in zip(reader.tensors, dtypes):
            writer.write_tensor_data(gguf.quants.dequantize(tensor.data, tensor.tensor_type).astype(dtype))
        writer.close()
    return dst


def write_llama_gguf(
    checkpoint_dir: str | os.PathLike, dst: str | os.PathLike, tokenizer_gguf: str | os.PathLike
) -> Path:
    """A llama-architecture F16 GGUF at `dst` of the Hugging Face Llama checkpoint `checkpoint_dir` (config.json and
    safetensors shards), laid out as llama.cpp's convert_hf_to_gguf.py writes one: tensors under llama.cpp's names
    (io.gguf_layout.gguf_name), q_proj and k_proj rows in its rotary order (io.gguf_layout.rotary_permutation), 2-D
    weights F16 [out, in], 1-D norms F32; the llama hyperparameters from config.json; every `tokenizer.*` field
    (model, pre-tokenizer, tokens, token types, merges, special ids, chat template) of `tokenizer_gguf`. llama.cpp
    then runs the checkpoint's weights (rounded to F16) with that tokenizer. Kept when `dst` is newer than the
    checkpoint's config.json; written under a staging name and renamed.

    Tensors are read and written one at a time: memory stays near one tensor, whatever the model's size. Raises
    ValueError naming both files when the checkpoint's vocab_size differs from the tokenizer's token count, naming
    the tensor for one outside llama.cpp's llama layout (biases, per-head q/k norms), and for RoPE scaling, which is
    not written."""
    import gguf
    import numpy as np
    import torch

    from flashllm_ext.io.checkpoint import open_checkpoint
    from flashllm_ext.io.gguf_layout import gguf_name, rotary_permutation

    checkpoint_dir, dst = Path(checkpoint_dir), Path(dst)
    if dst.is_file() and dst.stat().st_mtime > (checkpoint_dir / "config.json").stat().st_mtime:
        return dst
    ckpt = open_checkpoint(checkpoint_dir)
    config = ckpt.config
    tokenizer = gguf.GGUFReader(tokenizer_gguf)
    tokens = tokenizer.fields.get("tokenizer.ggml.tokens")
    if tokens is None:
        raise ValueError(f"{tokenizer_gguf} holds no tokenizer (no tokenizer.ggml.tokens)")
    vocab = int(config["vocab_size"])
    if vocab != len(tokens.data):
        raise ValueError(
            f"{checkpoint_dir}: vocab_size {vocab} differs from the {len(tokens.data)} tokens of {tokenizer_gguf}"
        )
    # transformers 5 writes rope_parameters (rope_theta inside); older configs rope_scaling beside rope_theta.
    rope = config.get("rope_parameters") or config.get("rope_scaling") or {}
    rope_type = rope.get("rope_type") or rope.get("type") or "default"
    if rope_type != "default":
        raise ValueError(f"{checkpoint_dir}: RoPE scaling {rope_type!r} is not written to the GGUF")
    hidden, heads = int(config["hidden_size"]), int(config["num_attention_heads"])
    kv_heads = int(config.get("num_key_value_heads") or heads)
    head_dim = int(config.get("head_dim") or hidden // heads)
    tied = bool(config.get("tie_word_embeddings", False))
    # (Hugging Face name, llama.cpp name, GGUF dtype), in the checkpoint's order; a tied LM head is the embedding,
    # which llama.cpp reads in place of an absent output.weight.
    plan = []
    for name in ckpt.names:
        if name == "lm_head.weight" and tied:
            continue
        target = gguf_name(name)
        if target is None or not name.endswith(".weight"):  # a q/k bias would need the rotary permutation too
            raise ValueError(f"{checkpoint_dir}: tensor {name} has no place in llama.cpp's llama layout")
        plan.append((name, target, np.dtype(np.float32 if len(ckpt.shape(name)) == 1 else np.float16)))

    with staged_file(dst) as tmp:
        writer = gguf.GGUFWriter(tmp, "llama")
        writer.add_name(checkpoint_dir.name)
        writer.add_context_length(int(config["max_position_embeddings"]))
        writer.add_embedding_length(hidden)
        writer.add_block_count(int(config["num_hidden_layers"]))
        writer.add_feed_forward_length(int(config["intermediate_size"]))
        writer.add_rope_dimension_count(head_dim)
        writer.add_head_count(heads)
        writer.add_head_count_kv(kv_heads)
        if "head_dim" in config:  # as the converter: llama.cpp's default is hidden_size / head_count
            writer.add_key_length(head_dim)
            writer.add_value_length(head_dim)
        writer.add_layer_norm_rms_eps(float(config["rms_norm_eps"]))
        writer.add_rope_freq_base(float(rope.get("rope_theta") or config.get("rope_theta", 10000.0)))
        writer.add_file_type(gguf.LlamaFileType.MOSTLY_F16)
        writer.add_vocab_size(vocab)
        for field in tokenizer.fields.values():
            if field.name.startswith("tokenizer."):
                _copy_field(writer, field)
        for name, target, dtype in plan:
            shape = ckpt.shape(name)
            writer.add_tensor_info(target, shape, dtype, math.prod(shape) * dtype.itemsize)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_ti_data_to_file()
        for name, _, dtype in plan:
            weight = ckpt[name]
            if name.endswith("self_attn.q_proj.weight"):
                weight = rotary_permutation(weight, heads)
            elif name.endswith("self_attn.k_proj.weight"):
                weight = rotary_permutation(weight, kv_heads)
            torch_dtype = torch.float32 if dtype == np.float32 else torch.float16
            writer.write_tensor_data(weight.to(torch_dtype).contiguous().numpy())
        writer.close()
    return dst


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m flashllm_ext.harness.llama_cpp", description=__doc__)
    parser.add_argument("--build", action="store_true", help="build the llama-cpp-python environment (once)")
    parser.add_argument("--run", action="store_true", help="measure a model and print one JSON row per run")
    parser.add_argument("--model", help="GGUF file (default: the default model)")
    parser.add_argument("--f16", action="store_true", help="run on the weights dequantized to F16 (cached beside)")
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--tokens", type=int, default=32, help="timed decode steps")
    parser.add_argument("--prompt", default=DEFAULT_PROMPT, help="text, tokenized by llama.cpp")
    parser.add_argument("--budget-mb", type=float, help="run in a memory cgroup of the worker's baseline + this")
    parser.add_argument("--repack", action="store_true", help="let llama.cpp repack (copy) the weights at load")
    args = parser.parse_args(argv)
    if args.build:
        ensure_env()
    if not args.run:
        return
    from flashllm_ext.hub.fetch import fetch_default

    model = Path(args.model) if args.model else fetch_default()
    if args.f16:
        model = write_f16_gguf(model, model.with_name(f"{model.stem}.F16.gguf"))
    limit = None if args.budget_mb is None else baseline_bytes() + int(args.budget_mb * 1e6)
    for threads in args.threads:
        row = run_llama_cpp(model, args.prompt, args.tokens, threads, repack=args.repack, memory_limit_bytes=limit)
        print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
