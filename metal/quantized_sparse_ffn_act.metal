// Body of quantized_sparse_ffn's activation kernel for mlx.core.fast.metal_kernel (activation.metal and blocks.metal
// are in its header): sparse_ffn_act.metal over bundle rows of GGUF blocks (flashllm_ext/ops/blocks.py BundleFormat:
// up | gate (GLU) | down), the input columns' dot products integer sums per block against the tokens quantized by
// quantize_x_blocks.metal. The Metal twin of ffn_act_kernel over QuantizedBundles (csrc/cuda/).
//
// Template parameters: T (float, half or bfloat16_t: the bias element, x's dtype), IN_FMT (the up / gate columns'
// BlockFormatCode), HAS_INDEX, HAS_BIAS (bool).
// Inputs:  codes [n_tok * n_blocks * kBlock] int8_t, scale and scaled_sum [n_tok * n_blocks] float (at most 8 tokens),
//          matrix [capacity * row_bytes] uint8_t, bias [capacity] T (1-element placeholder when !HAS_BIAS), index
//          [n_rows] int64_t (placeholder when !HAS_INDEX), params: 8 int64_t = {n_rows, num_used, d, n_tok,
//          activation, glu, row_bytes, col_bytes (bytes of the up or gate column)}, threshold [1] float.
// Output:  act [n_tok * n_rows] float, as sparse_ffn_act.metal's.
// Grid: 32 * n_rows threads rounded up to the threadgroup: a simdgroup per row, a lane per block (lane, lane + 32,
// ...). Index entries outside [0, num_used) are checked by the host first; the kernel writes 0 for them.
const int64_t n_rows = params[0];
const int64_t num_used = params[1];
const int64_t d = params[2];
const int n_tok = int(params[3]);
const int activation = int(params[4]);
const bool glu = params[5] != 0;
const int64_t row_bytes = params[6];
const int64_t col_bytes = params[7];
const uint lane = thread_index_in_simdgroup;
const int64_t o = int64_t(thread_position_in_grid.x / 32);
if (o >= n_rows) {
  return;
}
const int64_t r = HAS_INDEX ? index[o] : o;
float h[kFfnMaxTokens] = {};
if (r >= 0 && r < num_used) {
  const int64_t n_blocks = (d + kBlock - 1) / kBlock;
  const int64_t block_bytes = col_bytes / n_blocks;
  const device uint8_t* row = matrix + r * row_bytes;
  const device uint8_t* first = glu ? row + col_bytes : row;
  float up[kFfnMaxTokens] = {};
  for (int64_t b = lane; b < n_blocks; b += 32) {
    add_block_dots(IN_FMT, first + b * block_bytes, b, n_blocks, codes, scale, scaled_sum, n_tok, h);
    if (glu) {
      add_block_dots(IN_FMT, row + b * block_bytes, b, n_blocks, codes, scale, scaled_sum, n_tok, up);
    }
  }
  const float b = HAS_BIAS ? float(bias[r]) : 0.f;
  for (int t = 0; t < kFfnMaxTokens; ++t) {
    float a = ffn_activate(simd_sum(h[t]) + b, activation);
    if (glu) {
      a *= simd_sum(up[t]);
    }
    h[t] = fabs(a) <= threshold[0] ? 0.f : a;  // NaN stays
  }
}
if (lane == 0) {
  for (int t = 0; t < n_tok; ++t) {
    act[t * n_rows + o] = h[t];
  }
}
