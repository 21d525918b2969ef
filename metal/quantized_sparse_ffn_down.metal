// Body of quantized_sparse_ffn's output kernel for mlx.core.fast.metal_kernel (blocks.metal is in its header):
// sparse_ffn_down.metal over the down rows of GGUF-block bundles, each weight dequantized as read. The caller sums
// `partial` over chunks.
//
// Template parameters: DOWN_FMT (the down rows' BlockFormatCode), HAS_INDEX (bool).
// Inputs:  matrix [capacity * row_bytes] uint8_t, index [n_rows] int64_t (placeholder when !HAS_INDEX), act
//          [n_tok * n_rows] float (quantized_sparse_ffn_act.metal), params [7] int64_t = {n_rows, num_used, d,
//          n_tok, rows_per_chunk, row_bytes, down_offset (bytes before a row's down part)}.
// Output:  partial [chunks * n_tok * d] float, as sparse_ffn_down.metal's.
// Grid: (d, chunks) threads; thread (c, k) owns column c of chunk k. Rows whose activations are all zero are skipped.
const int64_t n_rows = params[0];
const int64_t num_used = params[1];
const int64_t d = params[2];
const int n_tok = int(params[3]);
const int64_t rows_per_chunk = params[4];
const int64_t row_bytes = params[5];
const int64_t down_offset = params[6];
const int64_t c = int64_t(thread_position_in_grid.x);
const int64_t k = int64_t(thread_position_in_grid.y);
if (c >= d) {
  return;
}
const int64_t n_blocks = (d + kBlock - 1) / kBlock;
const int64_t block_offset = down_offset + (c / kBlock) * ((row_bytes - down_offset) / n_blocks);
const int j = int(c % kBlock);
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
  const device uint8_t* blk = matrix + r * row_bytes + block_offset;
  float scale, term;
  block_scale(DOWN_FMT, blk, scale, term);
  const float w = scale * float(block_code(DOWN_FMT, blk, j)) + term;
  for (int t = 0; t < n_tok; ++t) {
    acc[t] += act[t * n_rows + o] * w;
  }
}
for (int t = 0; t < n_tok; ++t) {
  partial[(k * n_tok + t) * d + c] = acc[t];
}
