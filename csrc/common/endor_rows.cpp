#include "common/endor_rows.h"

namespace flashllm {

__attribute__((target_clones("popcnt", "default"))) int64_t endor_row_popcount(const uint8_t* row_bitmap,
                                                                               int64_t n_cols) {
  const int64_t n_bytes = (n_cols + 7) / 8;
  if ((n_cols % 8) && (row_bitmap[n_bytes - 1] >> (n_cols % 8))) return -1;
  int64_t count = 0, b = 0;
  for (; b + 8 <= n_bytes; b += 8) count += __builtin_popcountll(load_word<uint64_t>(row_bitmap + b));
  return count + __builtin_popcountll(load_mask_bytes(row_bitmap + b, n_bytes - b));
}

EndorAvx2Tables::EndorAvx2Tables() {
  for (int byte = 0; byte < 256; ++byte) {
    int rank = 0;
    for (int j = 0; j < 8; ++j) {
      const bool set = (byte >> j) & 1;
      perm32[byte][j] = set ? rank : 0;
      shuffle16[byte][2 * j] = set ? static_cast<uint8_t>(2 * rank) : 0x80;
      shuffle16[byte][2 * j + 1] = set ? static_cast<uint8_t>(2 * rank + 1) : 0x80;
      shuffle8[byte][j] = set ? static_cast<uint8_t>(rank) : 0x80;
      shuffle8[byte][j + 8] = 0x80;
      rank += set;
    }
  }
}

const EndorAvx2Tables& endor_avx2_tables() {
  static const EndorAvx2Tables tables;
  return tables;
}

}  // namespace flashllm
