"""Numbers the native kernels, the Metal bodies and Python must agree on. Each is defined once, in the C header
named beside it; this module mirrors them for Python and for the Metal bodies run by MLX (`metal_header()`, which
MLX prepends to each body, while the SIMT build of the same bodies includes the C headers themselves), and
tests/ops/test_kernel_constants.py fails when a mirror drifts from its header.
"""

from __future__ import annotations

from flashllm_ext.ops.blocks import BLOCK, BLOCK_FORMATS

# EndorRowCode (csrc/common/endor_codes.h): why a kernel refused an Endor row.
ENDOR_ROW_CODES = {
    "kEndorRowOk": 0,
    "kEndorRowIndexOutOfRange": 1,
    "kEndorRowOffsetsInvalid": 2,
    "kEndorRowPaddingBits": 3,
    "kEndorRowCountMismatch": 4,
}
# csrc/common/ffn_grid.h: tokens one sparse_ffn / endor_linear launch holds in registers (kFfnMaxTokens); rows per
# chunk of the down kernel and the cap on chunks (kFfnRowsPerChunk, kFfnMaxChunks).
FFN_MAX_TOKENS = 8
FFN_ROWS_PER_CHUNK = 16
FFN_MAX_CHUNKS = 32
# csrc/simt/bodies.h (kMetalThreadgroup): threads per threadgroup of every Metal dispatch.
METAL_THREADGROUP = 256


def metal_header() -> str:
    """The constants above, the block formats' codes and the block size (csrc/common/block_formats.h, mirrored in
    flashllm_ext.ops.blocks) as Metal program-scope constants, under their C names."""
    lines = [f"constant int {name} = {value};" for name, value in ENDOR_ROW_CODES.items()]
    lines.append(f"constant int kFfnMaxTokens = {FFN_MAX_TOKENS};")
    lines += [f"constant int k{f.name.upper()} = {f.code};" for f in BLOCK_FORMATS.values()]
    lines.append(f"constant int kBlock = {BLOCK};")
    return "\n".join(lines) + "\n"
