// GGUF blocks as the quantized sparse FFN Metal bodies read them, part of their header (flashllm_ext.mlx prepends
// it, the SIMT build includes it before them). Layout (flashllm_ext/ops/blocks.py): a float16 scale d (and q4_1's
// float16 minimum m), then kBlock codes; weight j is d * code_j + c, c = -8d (q4_0), m (q4_1) or 0 (q8_0). Byte j of
// a 4-bit block's codes holds code j in its low nibble and code j + 16 in its high one.
//
// fmt: a BlockFormatCode (kQ8_0, kQ4_0, kQ4_1; csrc/common/block_formats.h).

inline float block_half(const device uint8_t* p) {
  return float(as_type<half>(ushort(ushort(p[0]) | ushort(ushort(p[1]) << 8))));
}

// The block's scale d and the term c of its weights d * code + c.
inline void block_scale(int fmt, const device uint8_t* blk, thread float& d, thread float& c) {
  d = block_half(blk);
  c = fmt == kQ4_1 ? block_half(blk + 2) : fmt == kQ4_0 ? -8.f * d : 0.f;
}

// Code j (0 .. kBlock - 1) of the block: q8_0's signed q, a 4-bit block's nibble 0..15.
inline int block_code(int fmt, const device uint8_t* blk, int j) {
  if (fmt == kQ8_0) {
    return int(as_type<int8_t>(blk[2 + j]));
  }
  const int byte = int(blk[(fmt == kQ4_1 ? 4 : 2) + j % 16]);
  return j < 16 ? byte & 15 : byte >> 4;
}

// Adds block b's share of the dot products of a row with n_tok tokens quantized per block (codes, scale,
// scaled_sum: quantize_x_blocks.metal, n_blocks blocks a token) to acc: d * s * (integer sum of the code products) +
// c * s * (sum of x's codes), as the CPU and CUDA kernels compute it.
inline void add_block_dots(int fmt, const device uint8_t* blk, int64_t b, int64_t n_blocks,
                           const device int8_t* codes, const device float* scale, const device float* scaled_sum,
                           int n_tok, thread float* acc) {
  int w[kBlock];
  for (int j = 0; j < kBlock; ++j) {
    w[j] = block_code(fmt, blk, j);
  }
  float d, c;
  block_scale(fmt, blk, d, c);
  for (int t = 0; t < n_tok; ++t) {
    const int64_t k = t * n_blocks + b;
    const device int8_t* xq = codes + k * kBlock;
    int isum = 0;
    for (int j = 0; j < kBlock; ++j) {
      isum += w[j] * int(xq[j]);
    }
    acc[t] += d * (scale[k] * float(isum)) + c * scaled_sum[k];
  }
}
