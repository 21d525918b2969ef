"""How the operating system and the CUDA driver see a process's memory: page-locked host tensors, mapped files."""

import os


def page_locked(t) -> bool:
    """Whether tensor t's host memory is page-locked for CUDA as the driver sees it (cuPointerGetAttribute's memory
    type is host): pinned by torch or registered by cudaHostRegister. torch's Tensor.is_pinned() knows only its own
    pinned allocations (2.11: False for registered memory)."""
    import ctypes

    memory_type, host, attribute_memory_type = ctypes.c_uint(), 1, 2  # CU_MEMORYTYPE_HOST, CU_POINTER_ATTRIBUTE_...
    status = ctypes.CDLL("libcuda.so.1").cuPointerGetAttribute(
        ctypes.byref(memory_type), attribute_memory_type, ctypes.c_ulonglong(t.data_ptr())
    )
    return status == 0 and memory_type.value == host


def mapped_ranges(path: str) -> list[tuple[int, int]]:
    """Address ranges of this process's mappings of `path` (/proc/self/maps)."""
    real = os.path.realpath(path)
    ranges = []
    with open("/proc/self/maps") as f:
        for line in f:
            fields = line.split()
            if len(fields) >= 6 and fields[5] == real:
                begin, end = (int(a, 16) for a in fields[0].split("-"))
                ranges.append((begin, end))
    return ranges
