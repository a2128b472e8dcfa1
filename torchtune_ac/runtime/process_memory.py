"""The memory a training process needs besides its step's tensors, and how its resident memory follows them.

A process holds memory before its model exists: on a CPU, what importing torch, transformers and the rest made
resident (about 0.35 GiB); on CUDA, the context, the communicators' buffers and whatever the caching allocator has
reserved by then. ``fixed_bytes`` measures it, and the planner adds it to a step's estimate where it decides what
fits (``ac_mode: auto``, ``tune plan``).

A CPU process that steps holds more than that and its tensors: the code of the kernels it pages in, the math
libraries' buffers, the small allocations glibc keeps, the data's objects, what planning left behind. The planner
counts it as ``CPU_STEP_RUNTIME_BYTES``, above the 46 to 72 MiB measured on five workloads (``llama_small`` with
none, per-op and full AC, ``llama_small_32k`` with full AC, a 6.6 M-parameter Llama; 2 threads).

On a CPU, glibc keeps freed memory of allocations under its mmap threshold (which it raises up to 32 MiB as large
blocks are freed) for reuse, so a process's resident memory stays at the high-water mark of its heap, above its
live tensors (up to 1.4x them on ``llama_small``). ``follow_live_tensors`` sets the threshold to 128 KiB: every
tensor beyond it is mapped on its own and returned to the system when freed, as CUDA's caching allocator would
let ``max_memory_allocated`` show. The price is paid by every step: each such tensor's pages are faulted in and
zeroed at each allocation. A run pays it only where a memory budget must hold (``ac_mode: auto`` on a CPU).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import sys

import psutil
import torch

# mallopt's parameter number for the mmap threshold (<malloc.h>), and the threshold set.
_M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD_BYTES = 128 * 1024
# What a CPU process adds to its resident set once it steps, besides its tensors (see the module docstring).
CPU_STEP_RUNTIME_BYTES = 96 * 2**20
# A CUDA process's fixed cost where it cannot be measured (planning on a machine without the GPU): a CUDA 12
# context with cuBLAS loaded takes about 0.5 GiB.
ASSUMED_CUDA_FIXED_BYTES = 2**29


def follow_live_tensors() -> bool:
    """Have glibc map every allocation of ``MMAP_THRESHOLD_BYTES`` or more on its own, and unmap it when freed,
    so that resident memory follows live tensors (see the module docstring). Returns whether it applied: only
    on Linux with glibc; elsewhere it does nothing."""
    if not sys.platform.startswith("linux"):
        return False
    name = ctypes.util.find_library("c")
    if name is None:
        return False
    libc = ctypes.CDLL(name)
    if not hasattr(libc, "mallopt"):  # musl has none
        return False
    return bool(libc.mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES))


def fixed_bytes(device: torch.device) -> int:
    """What this process holds on ``device`` now, before its model: on a CPU its resident set; on CUDA the device
    memory in use (the context, the communicators' buffers and the caching allocator's reserve; on a shared GPU,
    other processes' too)."""
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        return total - free
    return psutil.Process().memory_info().rss
