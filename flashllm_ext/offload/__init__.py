"""Offloaded inference (Endor's main result): whole decoder layers placed in memory or on SSD by a DRAM budget.

    convert_offload(checkpoint, store_dir, endor=True)                 # once: a layer store, dense or Endor
    model = load_offload(store_dir, dram_budget="30%", mode="endor")  # a transformers model
    model = load_offload(store_dir, "30%", device="cuda", device_budget="20%")  # GPU, host memory, SSD
    model.generate(...); model.offload.stats()
    runtime = patch_offload(hf_model, store_dir, mode="dense"); runtime.unpatch(hf_model)   # an already loaded model
    decoder = flashllm_ext.decoder.offload.load_offload_decoder(store_dir, "30%")   # the lean decoder (CPU)

Placement, nearest first as Endor does: layers 0..k-1 (closest to the input) stay in memory, layers k..L-1 are read
from the store for every forward, k the most layers the budget holds next to the resident tensors (embeddings,
norms, biases) and the staging buffers. An SSD layer is one contiguous, aligned range of the store's file, read
with the parallel direct-I/O FlashReader into one of two preallocated slots; while a layer computes, the next
moved layer (cyclically: the last one's successor is the first moved layer of the next token) is fetched into the
other slot in a background thread, so reads hide behind compute where compute is long enough. With slots=1 the
next fetch starts once the layer's compute is done with the one slot: nothing hides, and the second slot's memory
holds one more layer (a GPU computes a decode layer in milliseconds, beside a fetch of tens to hundreds).

On a GPU (device="cuda") there are three tiers, as in Endor: the resident tensors and the first layers in GPU
memory (device_budget), the next layers in pinned host memory as stored (dram_budget; compressed in the Endor
modes), copied into a GPU slot for each use, the rest read from SSD straight into a GPU slot (kvikio, GPUDirect
Storage where the machine has it) or through a pinned buffer. Endor layers are decompressed on the GPU, so only
compressed bytes cross PCIe. A fetch waits (in the background thread) for the compute that last used its slot, so
the host never waits on the device for it. On the CPU the same three-tier path runs when asked for
(layers_on_device < layers_in_memory: Placement): the test double of the GPU's.

Modes, one placement code:
  dense                  dense store; in-memory layers dense, SSD layers read dense
  endor                  Endor store (pruned weights as values + bitmap, ~56% of the bytes at 50% sparsity);
                         in-memory layers decompressed once (dense, as in dense mode), SSD layers read compressed
  endor+more-resident    Endor store; in-memory layers kept compressed, so more of them fit the same budget
Endor matrices are computed with the fused `endor_linear` for decode (T <= LINEAR_MAX_TOKENS tokens: it reads the
compressed weight once, measured 1.2-2x dense F.linear and 2-3.5x decompress + F.linear,
docs/benchmarks/bench_endor.md) and by `endor_decompress` + F.linear for prompts (a GEMM amortises the decompression),
DECOMPRESS_BLOCK_BYTES of rows at a time into one reused buffer.

The store (`LayerStore`): a directory with
  layers.safetensors    every decoder-layer Linear weight (attention and FFN), layer by layer (the flash store's
                        AlignedWriter): `<name>` dense, or Endor as `<name>.values/.bitmap/.row_offsets` where that
                        is smaller than dense. A layer's tensors are contiguous, its first on a 4096-byte boundary,
                        the others 64 bytes apart, so one layer is one aligned read range with little padding.
  resident.safetensors  everything else (embeddings, norms, biases, LM head), in the store dtype.
A quantized store (dtype "q8" / "q4") holds every layer matrix as rows of GGUF blocks (a GGUF's kept bit for bit),
multiplied as stored by quantized_linear; its resident tensors are float16.
"""

from __future__ import annotations

from flashllm_ext.offload.store import (
    END_TENSOR,
    FORMAT_VERSION,
    LAYERS_FILE,
    LayerStore,
    MAGIC,
    MatrixEntry,
    RESIDENT_FILE,
    STORE_FILES,
    TENSOR_ALIGNMENT,
)
from flashllm_ext.offload.convert import convert_offload
from flashllm_ext.offload.placement import (
    BudgetTooSmall,
    COMPUTES,
    DECOMPRESS_BLOCK_BYTES,
    MODES,
    Placement,
    check_options,
    decompress_block_rows,
    default_slots,
    is_int,
    plan_placement,
)
from flashllm_ext.offload.runtime import (
    CUDA_LINEAR_MAX_TOKENS,
    LINEAR_MAX_TOKENS,
    OffloadRuntime,
    OffloadStats,
    OffloadedLinear,
)
from flashllm_ext.offload.api import load_offload, load_offloaded, patch_offload
