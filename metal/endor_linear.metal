// Body of the endor_linear kernel for mlx.core.fast.metal_kernel (MLX writes the signature): y = x W^T (+ bias) from
// an Endor tensor W, never materialising W.
//
// Template parameters: T (float, half or bfloat16_t: the values' type) and HAS_BIAS (bool).
// Inputs:  x [n_tok * n_cols] float, values [nnz] T, bitmap [n_rows * ceil(n_cols/8)] uint8_t,
//          row_offsets [n_rows+1] int64_t, bias [n_rows] float (a 1-element placeholder when !HAS_BIAS),
//          params [4] int64_t = {n_rows, n_cols, nnz, n_tok}, n_tok <= 8.
// Outputs: y [n_tok * n_rows] float, row_status [n_rows] int32_t (0 ok; otherwise the EndorRowCode of
//          csrc/common/endor_codes.h: 2 row_offsets not a range inside values, 3 a bit past n_cols set, 4 row length
//          != popcount of its bitmap row; the row's y is then left unwritten).
// The host checks row_offsets[0] == 0 and row_offsets[n_rows] == nnz.
// Grid: 32 * n_rows threads rounded up to the threadgroup, threadgroup a multiple of 32: one simdgroup per row.
//
// As metal/endor_decompress.metal walks a row: per step each lane takes one bitmap byte and
// simd_prefix_exclusive_sum of the popcounts gives it its first value; the lane then FMAs its values against x
// (read from device memory: no threadgroup staging, so no barrier, and Apple GPUs cache x, which every row reads),
// one float partial sum per token, and simd_sum finishes the row. The row is checked before any value is read.
const int64_t n_rows = params[0];
const int64_t n_cols = params[1];
const int64_t nnz = params[2];
const int n_tok = int(params[3]);
const int64_t row_bytes = (n_cols + 7) / 8;
const uint lane = thread_index_in_simdgroup;
const int64_t r = int64_t(thread_position_in_grid.x / 32);
if (r >= n_rows) {
  return;
}
const int64_t start = row_offsets[r];
const int64_t end = row_offsets[r + 1];
if (start < 0 || start > end || end > nnz) {
  if (lane == 0) {
    row_status[r] = kEndorRowOffsetsInvalid;
  }
  return;
}
const device uint8_t* row_bitmap = bitmap + r * row_bytes;
if ((n_cols & 7) != 0 && (row_bitmap[row_bytes - 1] >> (n_cols & 7)) != 0) {
  if (lane == 0) {
    row_status[r] = kEndorRowPaddingBits;
  }
  return;
}
uint set_bits = 0;
for (int64_t b = lane; b < row_bytes; b += 32) {
  set_bits += popcount(uint(row_bitmap[b]));
}
if (int64_t(simd_sum(set_bits)) != end - start) {
  if (lane == 0) {
    row_status[r] = kEndorRowCountMismatch;
  }
  return;
}
const device T* row_values = values + start;
float acc[kFfnMaxTokens] = {};
for (int64_t b0 = 0; b0 < row_bytes; b0 += 32) {
  const int64_t b = b0 + lane;
  const uint bits = b < row_bytes ? uint(row_bitmap[b]) : 0u;
  const uint count = popcount(bits);
  const uint first = simd_prefix_exclusive_sum(count);
  for (uint j = 0; j < 8; ++j) {
    if ((bits >> j & 1u) != 0) {
      const float w = float(row_values[first + popcount(bits & ((1u << j) - 1u))]);
      const int64_t col = 8 * b + j;
      for (int t = 0; t < n_tok; ++t) {
        acc[t] += w * x[t * n_cols + col];
      }
    }
  }
  row_values += simd_sum(count);
}
for (int t = 0; t < kFfnMaxTokens; ++t) {
  const float sum = simd_sum(acc[t]);
  if (lane == 0 && t < n_tok) {
    y[t * n_rows + r] = HAS_BIAS ? sum + bias[r] : sum;
  }
}
if (lane == 0) {
  row_status[r] = kEndorRowOk;
}
