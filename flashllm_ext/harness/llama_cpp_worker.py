"""One llama.cpp measurement, run as a file by the python of the llama-cpp-python environment
(flashllm_ext.harness.llama_cpp.ensure_env): it imports llama_cpp (and numpy, its dependency) and the standard
library only, never torch or flashllm_ext, so its memory is llama.cpp's alone. Prints one JSON object on stdout.

Greedy decoding: the prompt in one `eval` (prefill), then one token per `eval`, the next token the argmax of the
last position's logits; a decode token's time covers its `eval` and the argmax. The field names follow
bench/e2e_decode.py's rows so the two sit side by side."""

import argparse
import ctypes
import json
import os
import re
import statistics
import sys
import time


def process_memory() -> dict:
    """This process's memory now, in bytes (/proc/self/status): VmRSS, VmHWM (peak RSS), RssAnon, RssFile (file
    pages mapped: memory-mapped weights)."""
    with open("/proc/self/status") as f:
        lines = f.read().splitlines()
    return {
        key: int(value.split()[0]) * 1024
        for key, _, value in (line.partition(":") for line in lines)
        if key in ("VmRSS", "VmHWM", "RssAnon", "RssFile")
    }


def storage_reads() -> tuple:
    """(bytes read from storage on this process's behalf, major page faults): page-cache hits are not counted, a
    memory-mapped weight paged in from the file is."""
    import resource

    with open("/proc/self/io") as f:
        read_bytes = next(int(line.split()[1]) for line in f if line.startswith("read_bytes:"))
    return read_bytes, resource.getrusage(resource.RUSAGE_SELF).ru_majflt


def mb(value: int) -> float:
    return value / 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", help="GGUF file")
    parser.add_argument("--prompt-ids", help="comma-separated token ids")
    parser.add_argument("--prompt-text", help="text, tokenized by the model's tokenizer (special tokens parsed)")
    parser.add_argument("--tokens", type=int, default=32, help="timed decode steps after the prefill")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--n-ctx", type=int, default=512)
    parser.add_argument("--no-mmap", action="store_true", help="read the weights into memory instead of mapping them")
    parser.add_argument(
        "--repack",
        action="store_true",
        help="let llama.cpp copy weights into its extra buffer types (CPU_REPACK, AMX): anonymous memory",
    )
    parser.add_argument("--baseline", action="store_true", help="print the RSS after `import llama_cpp` and stop")
    args = parser.parse_args()

    # This file's folder holds the launcher llama_cpp.py: run without python's -I, `import llama_cpp` would find it.
    here = os.path.dirname(os.path.abspath(__file__))
    sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != here]
    import llama_cpp
    import numpy as np

    baseline = process_memory()
    if args.baseline:
        print(json.dumps({"rss_baseline_bytes": baseline["VmRSS"]}))
        return

    log_text = []

    # llama.cpp reports its buffers (CPU_Mapped: the mapped file; CPU_REPACK: weight copies) through its log.
    @llama_cpp.llama_log_callback
    def keep_log(level: int, text: bytes, user_data: ctypes.c_void_p) -> None:
        log_text.append(text.decode("utf-8", "replace"))

    llama_cpp.llama_log_set(keep_log, ctypes.c_void_p(0))

    # Llama() takes no use_extra_bufts argument but fills its model parameters from llama_model_default_params(),
    # replaced here by one that sets the field (False: llama.cpp's --no-repack), so the weights stay memory-mapped on
    # CPUs with repacked kernels (AMX; AVX2 and AVX-512 for Q4_0, Q8_0, the K-quants, IQ4_NL) instead of copied.
    default_params = llama_cpp.llama_cpp.llama_model_default_params

    def model_params():
        params = default_params()
        params.use_extra_bufts = args.repack
        return params

    llama_cpp.llama_cpp.llama_model_default_params = model_params

    row = {
        "peer": "llama.cpp",
        "llama_cpp_python": llama_cpp.__version__,
        "model": args.model,
        "threads": args.threads,
        "n_ctx": args.n_ctx,
        "use_mmap": not args.no_mmap,
        "repack": args.repack,
        "rss_baseline_mb": mb(baseline["VmRSS"]),
    }
    reads_before_load, _ = storage_reads()
    start = time.perf_counter()
    llm = llama_cpp.Llama(
        model_path=args.model,
        n_ctx=args.n_ctx,
        n_threads=args.threads,
        n_threads_batch=args.threads,
        use_mmap=not args.no_mmap,
        verbose=False,
    )
    load_s = time.perf_counter() - start
    # llama.cpp logs until the process exits (freeing the model does): hand it back llama-cpp-python's callback, a
    # module global, before keep_log goes out of scope.
    llama_cpp.llama_log_set(llama_cpp._logger.llama_log_callback, ctypes.c_void_p(0))
    loaded = process_memory()
    if args.prompt_ids:
        prompt = [int(t) for t in args.prompt_ids.split(",")]
    else:
        prompt = llm.tokenize(args.prompt_text.encode(), add_bos=True, special=True)
    if len(prompt) + args.tokens > args.n_ctx:
        parser.error(f"{len(prompt)} prompt tokens + {args.tokens} decode tokens do not fit n_ctx={args.n_ctx}")
    n_vocab = llm.n_vocab()

    def next_token() -> int:
        return int(np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(llm.ctx, -1), shape=(n_vocab,)).argmax())

    reads_before_prefill, _ = storage_reads()
    start = time.perf_counter()
    llm.eval(prompt)
    generated = [next_token()]
    prefill_s = time.perf_counter() - start
    read_before, faults_before = storage_reads()
    times = []
    for _ in range(args.tokens):
        start = time.perf_counter()
        llm.eval([generated[-1]])
        generated.append(next_token())
        times.append(time.perf_counter() - start)
    read_after, faults_after = storage_reads()
    end = process_memory()
    n = max(1, len(times))
    buffers = {}
    for kind, size in re.findall(r"(\S+ (?:model|KV|compute|output)) buffer size =\s*([\d.]+) MiB", "".join(log_text)):
        buffers[kind] = buffers.get(kind, 0.0) + float(size)
    row.update(
        prompt_tokens=len(prompt),
        load_s=load_s,
        load_read_mb=mb(reads_before_prefill - reads_before_load),
        prefill_s=prefill_s,
        prefill_tok_s=len(prompt) / prefill_s,
        prefill_read_mb=mb(read_before - reads_before_prefill),
        ms_per_token=statistics.median(times) * 1e3 if times else None,
        mean_ms_per_token=statistics.mean(times) * 1e3 if times else None,
        tokens=len(times),
        token_ms=[round(t * 1e3, 2) for t in times],
        generated=generated,
        proc_read_mb_per_token=mb(read_after - read_before) / n,
        major_faults_per_token=(faults_after - faults_before) / n,
        rss_load_mb=mb(loaded["VmRSS"]),
        rss_anon_load_mb=mb(loaded["RssAnon"]),
        rss_file_load_mb=mb(loaded["RssFile"]),
        rss_end_mb=mb(end["VmRSS"]),
        rss_peak_mb=mb(end["VmHWM"]),
        buffers_mib=buffers,
        system_info=llama_cpp.llama_print_system_info().decode().strip(),
    )
    print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
