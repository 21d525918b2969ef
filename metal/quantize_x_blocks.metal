// Body of the kernel that quantizes the tokens for quantized_sparse_ffn's Metal bodies, for
// mlx.core.fast.metal_kernel; the Metal twin of quantize_x_kernel in csrc/cuda/quantized_blocks.cuh. Per block of
// kBlock columns: s = max |x| / 127, code = round-half-away(x / s) (flashllm_ext/ops/blocks.py quantize_x_blocks); a
// block holding inf or NaN gets a NaN scale and zero codes, so every output it feeds is NaN, as the reference's.
//
// Inputs:  x [n_tok * d] float, params [3] int64_t = {n_tok, d, n_blocks}.
// Outputs: codes [n_tok * n_blocks * kBlock] int8_t (zeros past d), scale and scaled_sum [n_tok * n_blocks] float
//          (scaled_sum: s times the sum of the block's codes).
// Grid: 32 * n_tok * n_blocks threads rounded up to the threadgroup: a simdgroup per (token, block), lane j column j.
const int64_t n_tok = params[0];
const int64_t d = params[1];
const int64_t n_blocks = params[2];
const uint lane = thread_index_in_simdgroup;
const int64_t k = int64_t(thread_position_in_grid.x / 32);
if (k >= n_tok * n_blocks) {
  return;
}
const int64_t t = k / n_blocks;
const int64_t col = (k % n_blocks) * kBlock + lane;
const float v = col < d ? x[t * d + col] : 0.f;
const bool finite = !simd_ballot(!(v - v == 0.f)).any();  // inf - inf and NaN - NaN are NaN
const float amax = simd_max(fabs(v));
const float s = finite ? amax / 127.f : NAN;
const float inv = s == 0.f || !finite ? 0.f : 1.f / s;
const int code = finite ? int(round(v * inv)) : 0;
codes[k * kBlock + lane] = int8_t(code);
const int sum = simd_sum(code);
if (lane == 0) {
  scale[k] = s;
  scaled_sum[k] = s * float(sum);
}
