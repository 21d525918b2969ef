// Body of the sparse FFN activation kernel for mlx.core.fast.metal_kernel (MLX writes the signature; activation.metal
// is in its header); the Metal twin of ffn_act_kernel in csrc/cuda/sparse_ffn_kernel.cuh. Semantics: flashllm_ext/ops/
// (sparse_ffn).
//
// Template parameters: T (float, half or bfloat16_t: the matrix and bias element), HAS_INDEX, HAS_BIAS (bool).
// Inputs:  x [n_tok * d] float (at most 8 tokens), matrix [capacity * width] T (rows [up | gate (GLU) | down]),
//          bias [capacity] T (1-element placeholder when !HAS_BIAS), index [n_rows] int64_t (placeholder when
//          !HAS_INDEX), params [6] int64_t = {n_rows, num_used, d, n_tok, activation (0 relu, 1 silu, 2 gelu, 3 gelu_tanh), glu},
//          threshold [1] float.
// Output:  act [n_tok * n_rows] float: act[t * n_rows + o] = h, the activation (times x.up for GLU), zero where
//          |h| <= threshold (the active-neuron rule).
// Grid: 32 * n_rows threads rounded up to the threadgroup (a multiple of 32): one simdgroup per row. Lanes stride
// over the columns (consecutive lanes read consecutive elements), simd_sum reduces. Index entries outside
// [0, num_used) are checked by the host first; the kernel writes 0 for them and reads nothing.
const int64_t n_rows = params[0];
const int64_t num_used = params[1];
const int64_t d = params[2];
const int n_tok = int(params[3]);
const int activation = int(params[4]);
const bool glu = params[5] != 0;
const uint lane = thread_index_in_simdgroup;
const int64_t o = int64_t(thread_position_in_grid.x / 32);
if (o >= n_rows) {
  return;
}
const int64_t r = HAS_INDEX ? index[o] : o;
float h[kFfnMaxTokens] = {};
if (r >= 0 && r < num_used) {
  const device T* row = matrix + r * (glu ? 3 : 2) * d;
  const device T* first = glu ? row + d : row;
  float up[kFfnMaxTokens] = {};
  for (int64_t c = lane; c < d; c += 32) {
    const float w = float(first[c]);
    const float u = glu ? float(row[c]) : 0.f;
    for (int t = 0; t < n_tok; ++t) {
      h[t] += w * x[t * d + c];
      up[t] += u * x[t * d + c];
    }
  }
  const float b = HAS_BIAS ? float(bias[r]) : 0.f;
  for (int t = 0; t < kFfnMaxTokens; ++t) {
    const float v = simd_sum(h[t]) + b;
    float a = ffn_activate(v, activation);
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
