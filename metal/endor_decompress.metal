// Body of the Endor decompression kernel for mlx.core.fast.metal_kernel (MLX writes the signature).
//
// Template parameters: T (an unsigned integer as wide as the element: uint32_t, uint16_t or uint8_t; the kernel
// moves bits) and HAS_ROWS (bool: decompress rows[o] rather than row o).
// Inputs:  values [nnz] T, bitmap [n_rows * ceil(n_cols/8)] uint8_t, row_offsets [n_rows+1] int64_t,
//          rows [n_out] int64_t (a 1-element placeholder when !HAS_ROWS), params [4] int64_t = {n_rows, n_cols, nnz, n_out}.
// Outputs: out [n_out * n_cols] T, row_status [n_out] int32_t (0 ok; otherwise the EndorRowCode of
//          csrc/common/endor_codes.h: 1 row index out of range, 2 row_offsets not a range inside values,
//          3 a bit past n_cols set, 4 row length != popcount of its bitmap row).
// The host checks row_offsets[0] == 0 and row_offsets[n_rows] == nnz.
// Grid: 32 * n_out threads rounded up to the threadgroup, threadgroup a multiple of 32: one simdgroup per row.
//
// Per step each lane takes one bitmap byte; simd_prefix_exclusive_sum of the popcounts gives each lane its first
// value. The lanes then write the step's 256 columns in 8 rounds of 32 consecutive columns (lane l writes column
// 32k + l, getting its byte and first index from the owning lane with simd_shuffle), so reads and writes of
// values and out are contiguous across the simdgroup. Before reading values the row's range is checked against
// nnz, its padding bits and the popcount of its bitmap row; a bad row is skipped and reported in row_status.
const int64_t n_rows = params[0];
const int64_t n_cols = params[1];
const int64_t nnz = params[2];
const int64_t n_out = params[3];
const int64_t row_bytes = (n_cols + 7) / 8;
const uint lane = thread_index_in_simdgroup;
const int64_t o = int64_t(thread_position_in_grid.x / 32);
if (o >= n_out) {
  return;
}
const int64_t r = HAS_ROWS ? rows[o] : o;
if (r < 0 || r >= n_rows) {
  if (lane == 0) {
    row_status[o] = kEndorRowIndexOutOfRange;
  }
  return;
}
const int64_t start = row_offsets[r];
const int64_t end = row_offsets[r + 1];
if (start < 0 || start > end || end > nnz) {
  if (lane == 0) {
    row_status[o] = kEndorRowOffsetsInvalid;
  }
  return;
}
const device uint8_t* row_bitmap = bitmap + r * row_bytes;
if ((n_cols & 7) != 0 && (row_bitmap[row_bytes - 1] >> (n_cols & 7)) != 0) {
  if (lane == 0) {
    row_status[o] = kEndorRowPaddingBits;
  }
  return;
}
uint set_bits = 0;
for (int64_t b = lane; b < row_bytes; b += 32) {
  set_bits += popcount(uint(row_bitmap[b]));
}
if (int64_t(simd_sum(set_bits)) != end - start) {
  if (lane == 0) {
    row_status[o] = kEndorRowCountMismatch;
  }
  return;
}
const device T* row_values = values + start;
device T* dst = out + o * n_cols;
for (int64_t b0 = 0; b0 < row_bytes; b0 += 32) {
  const uint bits = b0 + lane < row_bytes ? uint(row_bitmap[b0 + lane]) : 0u;
  const uint count = popcount(bits);
  const uint first = simd_prefix_exclusive_sum(count);
  for (uint k = 0; k < 8; ++k) {
    const ushort owner = ushort(4 * k + lane / 8);
    const uint owner_bits = simd_shuffle(bits, owner);
    const uint owner_first = simd_shuffle(first, owner);
    const uint bit = lane % 8;
    const int64_t col = 8 * b0 + 32 * k + lane;
    if (col < n_cols) {
      dst[col] = (owner_bits >> bit & 1u)
                     ? row_values[owner_first + popcount(owner_bits & ((1u << bit) - 1u))]
                     : T(0);
    }
  }
  row_values += simd_sum(count);
}
if (lane == 0) {
  row_status[o] = kEndorRowOk;
}
