// Argument checks of flashllm::quantized_sparse_ffn and its bundle layout (flashllm_ext/ops/blocks.py:
// BundleFormat); flashllm_ext/ops/ffn.py makes the same checks for the reference kernel, with the same words.
#pragma once
#include <ATen/ATen.h>
#include <torch/library.h>

#include <optional>
#include <string>

#include "common/block_formats.h"
#include "common/sparse_ffn_checks.h"

namespace flashllm {

inline int parse_block_format(const std::string& name) {
  if (name == "q8_0") return kQ8_0;
  if (name == "q4_0") return kQ4_0;
  if (name == "q4_1") return kQ4_1;
  return -1;
}

// A bundle row: up | gate (GLU) | down, each ceil(d / 32) blocks; the input columns in in_format, down in down_format.
struct QuantizedBundle {
  int in_format, down_format;
  int64_t n_blocks, col_bytes, down_bytes, row_bytes;
};

inline QuantizedBundle parse_bundle_format(const std::string& name, int64_t d, bool glu) {
  const size_t plus = name.find('+');
  const int in = plus == std::string::npos ? -1 : parse_block_format(name.substr(0, plus));
  const int down = plus == std::string::npos ? -1 : parse_block_format(name.substr(plus + 1));
  TORCH_CHECK(in >= 0 && down >= 0,
              "quantized_sparse_ffn: bundle_format must be '<in format>+<down format>' of ('q8_0', 'q4_0', 'q4_1'), "
              "got '",
              name, "'");
  const int64_t nb = (d + kBlock - 1) / kBlock;
  const int64_t col = nb * block_bytes(in), down_bytes = nb * block_bytes(down);
  return {in, down, nb, col, down_bytes, (glu ? 2 : 1) * col + down_bytes};
}

inline QuantizedBundle check_quantized_sparse_ffn_args(const at::Tensor& x, const at::Tensor& matrix, int64_t num_used,
                                                       const std::optional<at::Tensor>& bias, bool glu,
                                                       const std::string& bundle_format,
                                                       const std::optional<at::Tensor>& index, double threshold) {
  const int64_t d = check_ffn_x("quantized_sparse_ffn", x);
  const QuantizedBundle b = parse_bundle_format(bundle_format, d, glu);
  TORCH_CHECK(matrix.scalar_type() == at::kByte && matrix.dim() == 2 && matrix.size(1) == b.row_bytes,
              "quantized_sparse_ffn: matrix must be uint8 of shape [capacity, ", b.row_bytes, "] (", bundle_format,
              " bundles of d=", d, ", glu=", glu ? "True" : "False", "), got ", matrix.scalar_type(), " of shape ",
              matrix.sizes());
  check_ffn_rows_args("quantized_sparse_ffn", x, matrix, b.row_bytes, num_used, bias, index, threshold);
  return b;
}

}  // namespace flashllm
