// torch.ops.flashllm_simt.{sparse_ffn_cuda, sparse_ffn_metal, quantized_sparse_ffn_cuda, quantized_sparse_ffn_metal,
// cache_compact_cuda}: the CUDA build's sparse FFN (float and quantized) and cache compaction launchers and the Metal
// sparse FFN kernel bodies (float and quantized) run on CPU tensors through the SIMT emulation, behind the host code of
// the real glue (common/ffn_host.h: the same checks, scratch sizes and result cast as csrc/cuda/ops_cuda.cpp).
#include <ATen/ATen.h>
#include <torch/library.h>

#include <algorithm>
#include <optional>
#include <stdexcept>
#include <string>

#include "common/ffn_grid.h"
#include "common/ffn_host.h"
#include "simt/ffn_bodies.h"

namespace flashllm {
namespace {

enum class Body { cuda, metal };

void require_cpu(const at::Tensor& t, const char* op) {
  TORCH_CHECK(t.device().is_cpu(), op, ": the SIMT emulation runs on CPU tensors, got ", t.device());
}

template <Body body>
at::Tensor sparse_ffn_simt(const at::Tensor& x, const at::Tensor& matrix, int64_t num_used,
                           const std::optional<at::Tensor>& bias, c10::string_view activation, bool glu,
                           const std::optional<at::Tensor>& index, double threshold, bool check_data) {
  require_cpu(x, "sparse_ffn");
  const std::optional<at::Tensor> bias_c = bias.has_value() ? std::optional<at::Tensor>(bias->contiguous()) : bias;
  return sparse_ffn_gpu_style(
      x, matrix, num_used, bias_c, activation, glu, index, threshold, check_data,
      [&](const at::Tensor& xf, int64_t n_rows, const int64_t* ids, int act, at::Tensor& y) {
        const int64_t n_tok = xf.size(0), d = xf.size(1), group = std::min<int64_t>(n_tok, kFfnMaxTokens);
        const FfnGrid g = ffn_grid(n_rows, d, static_cast<int>(matrix.element_size()));
        at::Tensor act_buf = at::zeros({group * n_rows}, xf.options());
        at::Tensor partial = at::zeros({g.chunks * group * d}, xf.options());
        const int kind = ffn_kind(matrix.scalar_type());
        const void* b = bias_c ? bias_c->data_ptr() : nullptr;
        try {
          if constexpr (body == Body::cuda) {
            simt_bodies::run_sparse_ffn_cuda(xf.data_ptr<float>(), n_tok, d, matrix.data_ptr(), kind, b, ids, n_rows,
                                             num_used, act, glu, float(threshold), act_buf.data_ptr<float>(),
                                             partial.data_ptr<float>(), y.data_ptr<float>());
          } else {
            // What flashllm_ext.mlx does: one act + down dispatch per group of 8 tokens, then mx.sum over chunks.
            for (int64_t t0 = 0; t0 < n_tok; t0 += kFfnMaxTokens) {
              const int64_t nt = std::min<int64_t>(kFfnMaxTokens, n_tok - t0);
              at::Tensor part = partial.narrow(0, 0, g.chunks * nt * d);
              simt_bodies::run_sparse_ffn_metal(xf.data_ptr<float>() + t0 * d, nt, d, matrix.data_ptr(), kind, b, ids,
                                                n_rows, num_used, act, glu, float(threshold), act_buf.data_ptr<float>(),
                                                g.chunks, g.rows_per_chunk, part.data_ptr<float>());
              y.narrow(0, t0, nt).copy_(part.view({g.chunks, nt, d}).sum(0));
            }
          }
        } catch (const std::runtime_error& e) {
          TORCH_CHECK(false, "sparse_ffn: SIMT emulation failed: ", e.what());
        }
      });
}

// check_data=false: unchecked rows, as the CUDA glue runs them without kernel checks.
// check_data=false runs the kernels on unchecked index entries, as the CUDA glue does without kernel checks.
at::Tensor sparse_ffn_simt_cuda(const at::Tensor& x, const at::Tensor& matrix, int64_t num_used,
                                const std::optional<at::Tensor>& bias, c10::string_view activation, bool glu,
                                const std::optional<at::Tensor>& index, double threshold, bool check_data) {
  return sparse_ffn_simt<Body::cuda>(x, matrix, num_used, bias, activation, glu, index, threshold, check_data);
}

// Always checked: flashllm_ext.mlx checks index on the host before dispatching the Metal kernels.
at::Tensor sparse_ffn_simt_metal(const at::Tensor& x, const at::Tensor& matrix, int64_t num_used,
                                 const std::optional<at::Tensor>& bias, c10::string_view activation, bool glu,
                                 const std::optional<at::Tensor>& index, double threshold) {
  return sparse_ffn_simt<Body::metal>(x, matrix, num_used, bias, activation, glu, index, threshold, true);
}

// check_data=false runs the kernels on unchecked index entries, as the CUDA glue does without kernel checks.
at::Tensor quantized_sparse_ffn_simt_cuda(const at::Tensor& x, const at::Tensor& matrix, int64_t num_used,
                                          const std::optional<at::Tensor>& bias, c10::string_view activation, bool glu,
                                          c10::string_view bundle_format, const std::optional<at::Tensor>& index,
                                          double threshold, bool check_data) {
  require_cpu(x, "quantized_sparse_ffn");
  return quantized_sparse_ffn_gpu_style(
      x, matrix, num_used, bias, activation, glu, std::string(bundle_format), index, threshold, check_data,
      [&](const QuantizedFfnCall& call, const at::Tensor& xf, int64_t n_rows, const int64_t* ids, int act,
          at::Tensor& y) {
        try {
          simt_bodies::run_quantized_sparse_ffn_cuda(
              xf.data_ptr<float>(), xf.size(0), xf.size(1), call.matrix.data_ptr<uint8_t>(), call.layout.row_bytes,
              call.layout.in_format, call.layout.down_format, call.bias_ptr(), ids, n_rows, num_used, act, glu,
              static_cast<float>(threshold), call.codes.data_ptr<int8_t>(), call.scale.data_ptr<float>(),
              call.scaled_sum.data_ptr<float>(), call.act_buf.data_ptr<float>(), call.partial.data_ptr<float>(),
              y.data_ptr<float>());
        } catch (const std::runtime_error& e) {
          TORCH_CHECK(false, "quantized_sparse_ffn: SIMT emulation failed: ", e.what());
        }
      });
}

// Always checked, as sparse_ffn_simt_metal.
at::Tensor quantized_sparse_ffn_simt_metal(const at::Tensor& x, const at::Tensor& matrix, int64_t num_used,
                                           const std::optional<at::Tensor>& bias, c10::string_view activation, bool glu,
                                           c10::string_view bundle_format, const std::optional<at::Tensor>& index,
                                           double threshold) {
  require_cpu(x, "quantized_sparse_ffn");
  return quantized_sparse_ffn_gpu_style(
      x, matrix, num_used, bias, activation, glu, std::string(bundle_format), index, threshold, true,
      [&](const QuantizedFfnCall& call, const at::Tensor& xf, int64_t n_rows, const int64_t* ids, int act,
          at::Tensor& y) {
        const int64_t n_tok = xf.size(0), d = xf.size(1), nb = call.layout.n_blocks;
        const FfnGrid g = ffn_grid(n_rows, d, kQuantizedDownElemBytes);
        try {
          // What flashllm_ext.mlx does: every token quantized in one dispatch, then one act + down dispatch per
          // group of 8 tokens and mx.sum over chunks.
          simt_bodies::run_quantize_x_metal(xf.data_ptr<float>(), n_tok, d, call.codes.data_ptr<int8_t>(),
                                            call.scale.data_ptr<float>(), call.scaled_sum.data_ptr<float>());
          for (int64_t t0 = 0; t0 < n_tok; t0 += kFfnMaxTokens) {
            const int64_t nt = std::min<int64_t>(kFfnMaxTokens, n_tok - t0);
            at::Tensor part = call.partial.narrow(0, 0, g.chunks * nt * d);
            simt_bodies::run_quantized_sparse_ffn_metal(
                call.codes.data_ptr<int8_t>() + t0 * nb * kBlock, call.scale.data_ptr<float>() + t0 * nb,
                call.scaled_sum.data_ptr<float>() + t0 * nb, nt, d, call.matrix.data_ptr<uint8_t>(),
                call.layout.row_bytes, call.layout.col_bytes, call.layout.in_format, call.layout.down_format,
                call.bias_ptr(), ids, n_rows, num_used, act, glu, static_cast<float>(threshold),
                call.act_buf.data_ptr<float>(), g.chunks, g.rows_per_chunk, part.data_ptr<float>());
            y.narrow(0, t0, nt).copy_(part.view({g.chunks, nt, d}).sum(0));
          }
        } catch (const std::runtime_error& e) {
          TORCH_CHECK(false, "quantized_sparse_ffn: SIMT emulation failed: ", e.what());
        }
      });
}

int64_t cache_compact_simt(at::Tensor& matrix, at::Tensor& pointer, const std::optional<at::Tensor>& bias,
                           const std::optional<at::Tensor>& slot_of, int64_t num_used, const at::Tensor& rows,
                           bool check_data) {
  require_cpu(matrix, "cache_compact");
  return cache_compact_gpu_style(
      matrix, pointer, bias, slot_of, num_used, rows, check_data, [&](const int64_t* sorted, int64_t c) {
        try {
          simt_bodies::run_cache_compact_cuda(
              static_cast<uint8_t*>(matrix.data_ptr()), matrix.size(1) * matrix.element_size(),
              pointer.data_ptr<int64_t>(), bias ? static_cast<uint8_t*>(bias->data_ptr()) : nullptr,
              bias ? static_cast<int>(bias->element_size()) : 0, slot_of ? slot_of->data_ptr<int64_t>() : nullptr,
              slot_of ? slot_of->numel() : 0, sorted, c, num_used);
        } catch (const std::runtime_error& e) {
          TORCH_CHECK(false, "cache_compact: SIMT emulation failed: ", e.what());
        }
      });
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(flashllm_simt, m) {
  m.def(
      "sparse_ffn_cuda(Tensor x, Tensor matrix, int num_used, Tensor? bias, str activation, bool glu, "
      "Tensor? index=None, float threshold=0.0, bool check_data=True) -> Tensor");
  m.def(
      "sparse_ffn_metal(Tensor x, Tensor matrix, int num_used, Tensor? bias, str activation, bool glu, "
      "Tensor? index=None, float threshold=0.0) -> Tensor");
  m.def(
      "quantized_sparse_ffn_cuda(Tensor x, Tensor matrix, int num_used, Tensor? bias, str activation, bool glu, "
      "str bundle_format, Tensor? index=None, float threshold=0.0, bool check_data=True) -> Tensor");
  m.def(
      "quantized_sparse_ffn_metal(Tensor x, Tensor matrix, int num_used, Tensor? bias, str activation, bool glu, "
      "str bundle_format, Tensor? index=None, float threshold=0.0) -> Tensor");
  m.def(
      "cache_compact_cuda(Tensor(a!) matrix, Tensor(b!) pointer, Tensor(c!)? bias, Tensor(d!)? slot_of, "
      "int num_used, Tensor rows, bool check_data=True) -> int");
}

TORCH_LIBRARY_IMPL(flashllm_simt, CPU, m) {
  m.impl("sparse_ffn_cuda", &sparse_ffn_simt_cuda);
  m.impl("sparse_ffn_metal", &sparse_ffn_simt_metal);
  m.impl("quantized_sparse_ffn_cuda", &quantized_sparse_ffn_simt_cuda);
  m.impl("quantized_sparse_ffn_metal", &quantized_sparse_ffn_simt_metal);
  m.impl("cache_compact_cuda", &cache_compact_simt);
}

}  // namespace flashllm
