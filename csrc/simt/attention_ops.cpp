// torch.ops.flashllm_simt.{decode_attention_cuda, merge_attention_states_cuda}: the CUDA build's attention
// launchers run on CPU tensors through the SIMT emulation, behind the host code of the real glue
// (common/attention_host.h: the same checks, layouts and outputs as csrc/cuda/ops_cuda.cpp).
#include <ATen/ATen.h>
#include <torch/library.h>

#include <optional>
#include <stdexcept>
#include <tuple>

#include "common/attention_host.h"
#include "simt/attention_bodies.h"

namespace flashllm {
namespace {

void require_cpu(const at::Tensor& t, const char* op) {
  TORCH_CHECK(t.device().is_cpu(), op, ": the SIMT emulation runs on CPU tensors, got ", t.device());
}

std::tuple<at::Tensor, at::Tensor> decode_attention_simt(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                                         std::optional<double> scale) {
  require_cpu(q, "decode_attention");
  return decode_attention_gpu_style(q, k, v, scale,
                                    [&](const at::Tensor& qf, const at::Tensor& kc, const at::Tensor& vc, int kind,
                                        const AttentionArgs& args, at::Tensor& out, at::Tensor& lse) {
                                      try {
                                        simt_bodies::run_decode_attention_cuda(
                                            qf.data_ptr<float>(), kc.data_ptr(), vc.data_ptr(), kind, args,
                                            out.data_ptr<float>(), lse.data_ptr<float>());
                                      } catch (const std::runtime_error& e) {
                                        TORCH_CHECK(false, "decode_attention: SIMT emulation failed: ", e.what());
                                      }
                                    });
}

std::tuple<at::Tensor, at::Tensor> merge_attention_states_simt(const at::Tensor& outs, const at::Tensor& lses) {
  require_cpu(outs, "merge_attention_states");
  return merge_attention_states_gpu_style(
      outs, lses,
      [&](const at::Tensor& oc, const at::Tensor& lc, int64_t n_parts, int64_t n_rows, int64_t head_dim,
          at::Tensor& out, at::Tensor& lse) {
        try {
          simt_bodies::run_merge_attention_states_cuda(oc.data_ptr<float>(), lc.data_ptr<float>(), n_parts, n_rows,
                                                       head_dim, out.data_ptr<float>(), lse.data_ptr<float>());
        } catch (const std::runtime_error& e) {
          TORCH_CHECK(false, "merge_attention_states: SIMT emulation failed: ", e.what());
        }
      });
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(flashllm_simt, m) {
  m.def("decode_attention_cuda(Tensor q, Tensor k, Tensor v, float? scale=None) -> (Tensor, Tensor)");
  m.def("merge_attention_states_cuda(Tensor outs, Tensor lses) -> (Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(flashllm_simt, CPU, m) {
  m.impl("decode_attention_cuda", &decode_attention_simt);
  m.impl("merge_attention_states_cuda", &merge_attention_states_simt);
}

}  // namespace flashllm
