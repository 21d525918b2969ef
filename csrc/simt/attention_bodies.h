// The attention GPU launchers compiled for the CPU SIMT emulation, behind plain functions (no torch headers on the
// body side): the CUDA build's launch_decode_attention and launch_merge_attention_states
// (csrc/simt/cuda_launchers.cpp).
#pragma once
#include <cstdint>

#include "common/attention_grid.h"

namespace flashllm::simt_bodies {

void run_decode_attention_cuda(const float* q, const void* k, const void* v, int kind, const AttentionArgs& args,
                               float* out, float* lse);
void run_merge_attention_states_cuda(const float* outs, const float* lses, int64_t n_parts, int64_t n_rows,
                                     int64_t head_dim, float* out, float* lse);

}  // namespace flashllm::simt_bodies
