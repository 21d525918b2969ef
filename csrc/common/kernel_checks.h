// The debug switch of the CUDA glue's data checks.
//
// Per-token GPU work must be capturable in a CUDA graph, so the CUDA glue never synchronises with the host on its
// per-call path: it checks metadata (dtypes, shapes, devices) only, and the kernels stay in bounds on any data
// (out-of-range ids are skipped, refused Endor rows come out as zeros; see each *_kernel.cuh). Data is validated
// where it enters instead (store open, load, cache planning on the host mirror). With kernel checks on, the glue
// also checks the data on the host, which synchronises and raises the CPU kernels' errors: for debugging, not for
// graph capture. Default off; FLASHLLM_CHECK_KERNELS=1 turns it on at load, flashllm_ext._C.set_kernel_checks at
// run time. The CPU kernels and the SIMT test ops always check.
#pragma once

namespace flashllm {

bool kernel_checks_enabled();
void set_kernel_checks(bool enabled);

}  // namespace flashllm
