"""Quantized weight blocks: GGUF's Q8_0, Q4_0 and Q4_1, the formats of a quantized flash store's bundles.

A row of d weights is ceil(d / 32) blocks of 32 consecutive weights (the last one zero-padded), each block its
float16 scale d (and, for q4_1, its float16 minimum m) followed by its codes, byte for byte as in a GGUF file:
  q8_0  34 bytes: d, 32 int8 codes q                   w = d * q
  q4_0  18 bytes: d, 16 bytes of 4-bit codes           w = d * (q - 8)
  q4_1  20 bytes: d, m, 16 bytes of 4-bit codes        w = d * q + m
4-bit codes: byte j holds weight j in its low nibble and weight j + 16 in its high nibble. A GGUF tensor's rows in
these types are these rows exactly, so a store keeps a file's blocks bit for bit; `quantize_rows` rounds as
`gguf.quants.quantize` does (ggml-quants.c's reference), so a row quantized here equals the one llama.cpp's tools
would write.

A token's x is quantized per block too (`quantize_x_blocks`: int8 codes with a float32 scale, Q8_0's rule), so a
row's dot product with x is integer sums per block (what llama.cpp computes).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from flashllm_ext.ops.gptq import gptq_codes

BLOCK = 32  # weights per block


@dataclass(frozen=True)
class BlockFormat:
    """One block type."""

    name: str
    code: int  # what the native kernels take: BlockFormatCode in csrc/common/block_formats.h
    block_bytes: int
    bits: int
    has_min: bool  # q4_1: w = d * q + m
    ggml_type: int  # gguf.GGMLQuantizationType of the same layout

    def row_bytes(self, d: int) -> int:
        """Bytes of a row of d weights."""
        return n_blocks(d) * self.block_bytes


BLOCK_FORMATS = {
    "q8_0": BlockFormat("q8_0", 0, 34, 8, False, 8),
    "q4_0": BlockFormat("q4_0", 1, 18, 4, False, 2),
    "q4_1": BlockFormat("q4_1", 2, 20, 4, True, 3),
}


def n_blocks(d: int) -> int:
    return -(-d // BLOCK)


def block_format(name: str) -> BlockFormat:
    """The format called `name`; ValueError listing the known ones otherwise."""
    if name not in BLOCK_FORMATS:
        raise ValueError(f"block format must be one of {tuple(BLOCK_FORMATS)}, got {name!r}")
    return BLOCK_FORMATS[name]


def _round_half_away(v: torch.Tensor) -> torch.Tensor:
    """roundf (half away from zero), exactly: floor(a) + floor(2 (a - floor(a))) has no rounding step (ggml's)."""
    a = v.abs()
    floored = a.floor()
    return v.sign() * (floored + (2 * (a - floored)).floor())


def _padded_blocks(w: torch.Tensor) -> torch.Tensor:
    """[R, d] float -> [R, nb, 32] float32, zero-padded."""
    rows, d = w.shape
    pad = n_blocks(d) * BLOCK - d
    w = w.float()
    if pad:
        w = torch.cat([w, w.new_zeros(rows, pad)], dim=1)
    return w.reshape(rows, -1, BLOCK)


def _scale_bytes(v: torch.Tensor) -> torch.Tensor:
    """[R, nb, 1] float32 -> its float16 bytes [R, nb, 2]."""
    return v.to(torch.float16).contiguous().view(torch.uint8)


def _pack_nibbles(q: torch.Tensor) -> torch.Tensor:
    """[R, nb, 32] codes 0..15 -> [R, nb, 16] bytes (weight j low, weight j + 16 high)."""
    q = q.to(torch.uint8)
    return q[..., :16] | (q[..., 16:] << 4)


def _check_rows(w: torch.Tensor) -> None:
    if w.dim() != 2 or not w.is_floating_point():
        raise ValueError(f"quantize_rows: w must be a 2-D float tensor, got {w.dtype} of shape {tuple(w.shape)}")
    if not bool(torch.isfinite(w).all()):
        raise ValueError("quantize_rows: w holds inf or NaN")


def _pack_blocks(f: BlockFormat, d: torch.Tensor, m: torch.Tensor | None, q: torch.Tensor) -> torch.Tensor:
    """Scales d [R, nb, 1] (and q4_1's minimums m), codes q [R, nb, 32] (q8_0: -127..127, else 0..15) -> the
    blocks uint8 [R, nb * block_bytes]."""
    if f.bits == 8:
        parts = [_scale_bytes(d), q.to(torch.int8).view(torch.uint8)]
    else:
        parts = [_scale_bytes(d), *([_scale_bytes(m)] if f.has_min else []), _pack_nibbles(q)]
    return torch.cat(parts, dim=-1).reshape(q.shape[0], -1)


def quantize_rows(w: torch.Tensor, fmt: str) -> torch.Tensor:
    """Rows w [R, d] (any float dtype) -> their blocks uint8 [R, fmt.row_bytes(d)], rounded as ggml-quants.c's
    reference quantizers round (bit for bit what `gguf.quants.quantize` gives for d a multiple of 32)."""
    f = block_format(fmt)
    _check_rows(w)
    blocks = _padded_blocks(w)
    m = None
    if f.name == "q8_0":
        d = blocks.abs().amax(dim=-1, keepdim=True) / 127
        inv = torch.where(d == 0, torch.zeros_like(d), 1 / d)
        q = _round_half_away(blocks * inv)
    elif f.name == "q4_0":
        signed_max = blocks.gather(-1, blocks.abs().argmax(dim=-1, keepdim=True))
        d = signed_max / -8
        inv = torch.where(d == 0, torch.zeros_like(d), 1 / d)
        q = (blocks * inv + 8.5).trunc().clamp(0, 15)
    else:
        m, hi = blocks.amin(dim=-1, keepdim=True), blocks.amax(dim=-1, keepdim=True)
        d = (hi - m) / 15
        inv = torch.where(d == 0, torch.zeros_like(d), 1 / d)
        q = ((blocks - m) * inv + 0.5).trunc().clamp(0, 15)
    return _pack_blocks(f, d, m, q)


def quantize_rows_gptq(w: torch.Tensor, fmt: str, factor: torch.Tensor) -> torch.Tensor:
    """The rows of a linear layer's weight w [out, in] as quantize_rows gives them (uint8 [out, fmt.row_bytes(in)],
    the same scales and minimums), the codes rounded by GPTQ (flashllm_ext.ops.gptq) against the layer's inputs,
    whose gptq_factor is `factor` [in, in]: an FFN's up and gate rows."""
    grid = _BlockGrid(w, fmt)
    codes = gptq_codes(w, factor, grid.scale, grid.offset, BLOCK, grid.lo, grid.hi)
    return grid.pack(codes)


def quantize_columns_gptq(w: torch.Tensor, fmt: str, factor: torch.Tensor) -> torch.Tensor:
    """The columns of a linear layer's weight w [out, in] as quantize_rows(w.t()) gives them (uint8 [in,
    fmt.row_bytes(out)], the same scales and minimums), the codes rounded by GPTQ against the layer's inputs, whose
    gptq_factor is `factor` [in, in]: an FFN's down rows (neuron i's is column i of W_down). Each column GPTQ rounds
    is a whole row of blocks, so every weight of it has its own block's grid."""
    out = w.shape[0]
    grid = _BlockGrid(w.t(), fmt)
    per_weight = [t.repeat_interleave(BLOCK, dim=1)[:, :out].t().contiguous() for t in (grid.scale, grid.offset)]
    codes = gptq_codes(w, factor, *per_weight, 1, grid.lo, grid.hi)
    return grid.pack(codes.t())


class _BlockGrid:
    """The grid quantize_rows puts rows w [R, d] on, as stored: per block, w_q = scale * q + offset (float32
    [R, nb]; q8_0: offset 0, q4_0: -8 scale, q4_1: the minimum) with q in [lo, hi]."""

    def __init__(self, w: torch.Tensor, fmt: str) -> None:
        self.format = block_format(fmt)
        self.rows, self.cols = w.shape
        nearest = quantize_rows(w, fmt).reshape(self.rows, -1, self.format.block_bytes)
        self.scale = nearest[..., 0:2].contiguous().view(torch.float16).float().squeeze(-1)
        self.minimum = None
        if self.format.has_min:
            self.minimum = nearest[..., 2:4].contiguous().view(torch.float16).float().squeeze(-1)
        if self.format.bits == 8:
            self.offset, (self.lo, self.hi) = torch.zeros_like(self.scale), (-127, 127)
        else:
            self.offset = -8 * self.scale if self.minimum is None else self.minimum
            self.lo, self.hi = 0, 15

    def pack(self, codes: torch.Tensor) -> torch.Tensor:
        """Codes [R, d] -> the blocks uint8 [R, row_bytes(d)], the padding weights (zeros) rounded to nearest."""
        codes = codes.float()
        pad = n_blocks(self.cols) * BLOCK - self.cols
        if pad:
            last_scale, last_offset = self.scale[:, -1:], self.offset[:, -1:]
            inverse = torch.where(last_scale == 0, torch.zeros_like(last_scale), 1 / last_scale)
            zero = torch.clamp(torch.round(-last_offset * inverse), self.lo, self.hi)
            codes = torch.cat([codes, zero.expand(self.rows, pad)], dim=1)
        blocks = codes.reshape(self.rows, -1, BLOCK)
        minimum = None if self.minimum is None else self.minimum.unsqueeze(-1)
        return _pack_blocks(self.format, self.scale.unsqueeze(-1), minimum, blocks)


def dequantize_rows(codes: torch.Tensor, fmt: str, d: int) -> torch.Tensor:
    """Blocks uint8 [R, fmt.row_bytes(d)] -> the weights float32 [R, d] (as `gguf.quants.dequantize` computes them:
    d * q, d * (q - 8), d * q + m, in float32). Works on any device."""
    f = block_format(fmt)
    if codes.dtype != torch.uint8 or codes.dim() != 2 or codes.shape[1] != f.row_bytes(d):
        raise ValueError(
            f"dequantize_rows: codes must be uint8 [R, {f.row_bytes(d)}] ({f.name} rows of d={d}), got "
            f"{codes.dtype} of shape {tuple(codes.shape)}"
        )
    rows = codes.shape[0]
    nb = n_blocks(d)
    blocks = codes.reshape(rows, nb, f.block_bytes)
    scale = blocks[..., 0:2].contiguous().view(torch.float16).float()
    if f.bits == 8:
        w = blocks[..., 2:].contiguous().view(torch.int8).float() * scale
    else:
        packed = blocks[..., 4 if f.has_min else 2 :]
        q = torch.cat([packed & 0x0F, packed >> 4], dim=-1).float()
        if f.has_min:
            w = scale * q + blocks[..., 2:4].contiguous().view(torch.float16).float()
        else:
            w = scale * (q - 8)
    return w.reshape(rows, nb * BLOCK)[:, :d]


def quantize_x_blocks(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Tokens x [T, d] -> (codes int8 [T, nb, 32], scales float32 [T, nb]): per block of 32 columns (the last
    zero-padded) scale = max |x| / 127 and code = round-half-away(x * (1 / scale)), 0 where the block is all zeros:
    Q8_0's rule with the scale kept in float32. The native kernels quantize x exactly so."""
    blocks = _padded_blocks(x)
    scale = blocks.abs().amax(dim=-1, keepdim=True) / 127
    inv = torch.where(scale == 0, torch.zeros_like(scale), 1 / scale)
    return _round_half_away(blocks * inv).to(torch.int8), scale.squeeze(-1)


@dataclass(frozen=True)
class BundleFormat:
    """The layout of a quantized bundle row: up | gate (GLU) | down, each a row of `d` weights in blocks, the
    input columns (up, gate) in `in_format`, the down row in `down_format`."""

    in_format: str
    down_format: str

    def __post_init__(self) -> None:
        block_format(self.in_format), block_format(self.down_format)

    @property
    def name(self) -> str:
        """How a store's metadata names it, e.g. "q4_0+q8_0" (input columns + down row)."""
        return f"{self.in_format}+{self.down_format}"

    @classmethod
    def parse(cls, name: str) -> BundleFormat:
        """The inverse of `name`; ValueError on anything else."""
        parts = name.split("+")
        if len(parts) != 2:
            raise ValueError(f"a bundle format is '<in format>+<down format>', got {name!r}")
        return cls(*parts)

    def part_bytes(self, d: int) -> tuple[int, int]:
        """Bytes of an input column, of the down row."""
        return BLOCK_FORMATS[self.in_format].row_bytes(d), BLOCK_FORMATS[self.down_format].row_bytes(d)

    def row_bytes(self, d: int, glu: bool) -> int:
        """Bytes of one bundle row."""
        col, down = self.part_bytes(d)
        return (2 if glu else 1) * col + down

    def quantize(self, up: torch.Tensor, down: torch.Tensor, gate: torch.Tensor | None = None) -> torch.Tensor:
        """Quantized bundle rows of one layer: up, gate [n, d] (nn.Linear weights), down [d, n] (its column i is
        neuron i's down row) -> uint8 [n, row_bytes(d, gate is not None)]."""
        parts = [quantize_rows(up, self.in_format)]
        if gate is not None:
            parts.append(quantize_rows(gate, self.in_format))
        parts.append(quantize_rows(down.t(), self.down_format))
        return torch.cat(parts, dim=1)

    def dequantize(self, rows: torch.Tensor, d: int, glu: bool) -> torch.Tensor:
        """Quantized bundle rows uint8 [R, row_bytes(d, glu)] -> the float32 bundles [R, (3 if glu else 2) d]."""
        col, _ = self.part_bytes(d)
        if rows.dtype != torch.uint8 or rows.dim() != 2 or rows.shape[1] != self.row_bytes(d, glu):
            raise ValueError(
                f"bundle rows must be uint8 [R, {self.row_bytes(d, glu)}] ({self.name} bundles of d={d}, "
                f"glu={glu}), got {rows.dtype} of shape {tuple(rows.shape)}"
            )
        n_in = 2 if glu else 1
        parts = [dequantize_rows(rows[:, k * col : (k + 1) * col], self.in_format, d) for k in range(n_in)]
        parts.append(dequantize_rows(rows[:, n_in * col :], self.down_format, d))
        return torch.cat(parts, dim=1)


@dataclass
class QuantizedWeight:
    """A 2-D weight [rows, cols] held as rows of GGUF blocks (a quantized store's resident linears and embeddings):
    `blocks` uint8 [rows, BLOCK_FORMATS[fmt].row_bytes(cols)]. ops.quantized_linear multiplies by it; `rows`
    dequantizes the rows an embedding looks up."""

    blocks: torch.Tensor
    fmt: str
    cols: int

    def __post_init__(self) -> None:
        width = block_format(self.fmt).row_bytes(self.cols)
        if self.blocks.dtype != torch.uint8 or self.blocks.dim() != 2 or self.blocks.shape[1] != width:
            raise ValueError(
                f"blocks must be uint8 [rows, {width}] ({self.fmt} rows of {self.cols}), got {self.blocks.dtype} "
                f"of shape {tuple(self.blocks.shape)}"
            )

    @property
    def shape(self) -> tuple[int, int]:
        return self.blocks.shape[0], self.cols

    @property
    def nbytes(self) -> int:
        return self.blocks.nbytes

    @property
    def device(self) -> torch.device:
        return self.blocks.device

    def to(self, device: torch.device | str) -> QuantizedWeight:
        return QuantizedWeight(self.blocks.to(device), self.fmt, self.cols)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The whole weight as floats [rows, cols]."""
        return dequantize_rows(self.blocks, self.fmt, self.cols).to(dtype)

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows `ids` [k] dequantized: float32 [k, cols] (an embedding's lookup)."""
        return dequantize_rows(self.blocks[ids], self.fmt, self.cols)

    @staticmethod
    def cat(weights: list[QuantizedWeight]) -> QuantizedWeight:
        """The weights' rows one after another (fused q/k/v). Weights of different formats are quantized again, as
        q8_0, from their values (a GGUF may hold v in another type than q and k)."""
        cols = {w.cols for w in weights}
        if len(cols) != 1:
            raise ValueError(f"weights to concatenate have different column counts {sorted(cols)}")
        fmts = {w.fmt for w in weights}
        if len(fmts) == 1:
            return QuantizedWeight(torch.cat([w.blocks for w in weights]), weights[0].fmt, weights[0].cols)
        dense = torch.cat([w.dequantize() for w in weights])
        return QuantizedWeight(quantize_rows(dense, "q8_0"), "q8_0", weights[0].cols)
