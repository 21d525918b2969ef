"""Host buffers that direct I/O and DMA need: ALIGNMENT-aligned memory and page-locked (pinned) memory."""

from __future__ import annotations

import weakref

import torch


ALIGNMENT = 4096  # O_DIRECT offsets, lengths and buffers: the logical block size of every disk here


def aligned_buffer(nbytes: int) -> torch.Tensor:
    """uint8 [nbytes] of host memory starting on an ALIGNMENT boundary, so direct reads land in it without a bounce
    copy."""
    raw = torch.empty(nbytes + ALIGNMENT, dtype=torch.uint8)
    skip = -raw.data_ptr() % ALIGNMENT
    return raw[skip : skip + nbytes]


def pinned_buffer(nbytes: int) -> torch.Tensor:
    """An aligned_buffer pinned by registering its pages with CUDA (cudaHostRegister, as torch's checkpoint stager
    does): it pins what it holds, where a pinned tensor from torch's caching host allocator pins the next power of
    two (pinned_bytes: a 403 MB layer would pin 512 MB). Unregistered when the tensor is freed, so free it only once
    no copy from it is in flight."""
    buffer = aligned_buffer(nbytes)
    if nbytes:
        cudart, address = torch.cuda.cudart(), buffer.data_ptr()
        status = int(cudart.cudaHostRegister(address, nbytes, 0))
        if status != 0:
            raise RuntimeError(f"pinning {nbytes} bytes of host memory failed (cudaHostRegister: cudaError {status})")
        weakref.finalize(buffer, cudart.cudaHostUnregister, address)
    return buffer


def pinned_bytes(nbytes: int) -> int:
    """The host memory torch pins for a pinned tensor of nbytes: its caching host allocator rounds every request up
    to a power of two (ATen/core/CachingHostAllocator.h), so a staged layer of 0.53 GiB pins 1 GiB."""
    return 0 if nbytes <= 0 else 1 << (nbytes - 1).bit_length()
