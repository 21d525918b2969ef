// Body of the sparse FFN output kernel for mlx.core.fast.metal_kernel; the Metal twin of ffn_down_kernel in
// csrc/cuda/sparse_ffn_kernel.cuh. The caller sums `partial` over chunks (the final reduction, mx.sum).
//
// Template parameters: T (float, half or bfloat16_t), HAS_INDEX (bool).
// Inputs:  matrix [capacity * width] T, index [n_rows] int64_t (placeholder when !HAS_INDEX), act [n_tok * n_rows]
//          float (sparse_ffn_act.metal), params [6] int64_t = {n_rows, num_used, d, n_tok, glu, rows_per_chunk}.
// Output:  partial [chunks * n_tok * d] float: partial[(k * n_tok + t) * d + c] = sum over the rows o of chunk k of
//          act[t, o] * down_row(o)[c].
// Grid: (d, chunks) threads; thread (c, k) owns column c of chunk k, so a simdgroup reads 32 consecutive elements
// of each down row. Rows whose activations are all zero are skipped.
const int64_t n_rows = params[0];
const int64_t num_used = params[1];
const int64_t d = params[2];
const int n_tok = int(params[3]);
const bool glu = params[4] != 0;
const int64_t rows_per_chunk = params[5];
const int64_t c = int64_t(thread_position_in_grid.x);
const int64_t k = int64_t(thread_position_in_grid.y);
if (c >= d) {
  return;
}
const int64_t width = (glu ? 3 : 2) * d;
const int64_t down_offset = (glu ? 2 : 1) * d;
const int64_t begin = k * rows_per_chunk;
const int64_t end = min(begin + rows_per_chunk, n_rows);
float acc[kFfnMaxTokens] = {};
for (int64_t o = begin; o < end; ++o) {
  const int64_t r = HAS_INDEX ? index[o] : o;
  if (r < 0 || r >= num_used) {
    continue;
  }
  bool any = false;
  for (int t = 0; t < n_tok; ++t) {
    any = any || act[t * n_rows + o] != 0.f;
  }
  if (!any) {
    continue;
  }
  const float w = float(matrix[r * width + down_offset + c]);
  for (int t = 0; t < n_tok; ++t) {
    acc[t] += act[t * n_rows + o] * w;
  }
}
for (int t = 0; t < n_tok; ++t) {
  partial[(k * n_tok + t) * d + c] = acc[t];
}
