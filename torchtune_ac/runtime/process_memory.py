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

Every other CPU run keeps what it frees (``keep_freed_memory``). Under glibc's defaults the mmap threshold starts at
128 KiB and only rises as mapped blocks are freed, and the top of the heap is given back to the system whenever
more than twice the threshold lies free there; a training step frees most of what it allocated, so the next step
faults the same pages in again and the kernel zeroes them: 20,000 to 27,000 page faults and 40 to 76 ms of system
time a step on ``bench_vlm.py``'s 43 M-parameter model (a tenth of its step). Fixing the threshold at glibc's own
ceiling (32 MiB on 64-bit) and never trimming keeps the step's blocks for the next step: one fault a step, the same
peak resident set (the step's high-water mark is reached either way), and the resident set stays at that peak
between steps, where glibc's defaults would hand part of it back until the next step. A user's own ``MALLOC_*``
settings or ``GLIBC_TUNABLES`` are left as they are.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import sys

import psutil
import torch

# mallopt's parameter numbers (<malloc.h>), and the thresholds set.
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD_BYTES = 128 * 1024
# keep_freed_memory's: glibc's ceiling for the mmap threshold on 64-bit (DEFAULT_MMAP_THRESHOLD_MAX; mallopt refuses
# more), and a trim threshold no heap's free top reaches in practice (mallopt takes an int).
KEEP_MMAP_THRESHOLD_BYTES = 32 * 2**20
KEEP_TRIM_THRESHOLD_BYTES = 2**31 - 1
# Environment variables through which a user sets glibc's malloc; where one is set, keep_freed_memory leaves it be.
_USER_MALLOC_SETTINGS = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "MALLOC_TOP_PAD_", "MALLOC_MMAP_MAX_",
                         "GLIBC_TUNABLES")
# What a CPU process adds to its resident set once it steps, besides its tensors (see the module docstring).
CPU_STEP_RUNTIME_BYTES = 96 * 2**20
# A CUDA process's fixed cost where it cannot be measured (planning on a machine without the GPU): a CUDA 12
# context with cuBLAS loaded takes about 0.5 GiB.
ASSUMED_CUDA_FIXED_BYTES = 2**29
# torch's cuBLAS workspace per handle on a GPU of compute capability 9 or newer (CUBLAS_WORKSPACE_CONFIG's default
# ":4096:8"; cuBLASLt shares it), assumed where no GPU can be asked; and the threads of a step that multiply
# matrices, each with a handle of its own: the forward's, and autograd's thread for the device in backward.
ASSUMED_CUBLAS_WORKSPACE_BYTES = 32 * 2**20
STEP_BLAS_THREADS = 2


def _glibc():
    """The C library where it is glibc with ``mallopt`` (Linux), else None."""
    if not sys.platform.startswith("linux"):
        return None
    name = ctypes.util.find_library("c")
    if name is None:
        return None
    libc = ctypes.CDLL(name)
    return libc if hasattr(libc, "mallopt") else None  # musl has none


def follow_live_tensors() -> bool:
    """Have glibc map every allocation of ``MMAP_THRESHOLD_BYTES`` or more on its own, and unmap it when freed,
    so that resident memory follows live tensors (see the module docstring). Returns whether it applied: only
    on Linux with glibc; elsewhere it does nothing."""
    libc = _glibc()
    return libc is not None and bool(libc.mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES))


def keep_freed_memory() -> bool:
    """Have glibc keep the blocks a step frees for the next step instead of giving them back to the system and
    faulting them in again (see the module docstring): the mmap threshold fixed at ``KEEP_MMAP_THRESHOLD_BYTES``,
    the heap never trimmed. Returns whether it applied: only on Linux with glibc, and only where the user has not
    set glibc's malloc through the environment."""
    libc = _glibc()
    if libc is None or any(name in os.environ for name in _USER_MALLOC_SETTINGS):
        return False
    return bool(libc.mallopt(_M_MMAP_THRESHOLD, KEEP_MMAP_THRESHOLD_BYTES)) and bool(
        libc.mallopt(_M_TRIM_THRESHOLD, KEEP_TRIM_THRESHOLD_BYTES))


def fixed_bytes(device: torch.device) -> int:
    """What this process holds on ``device`` now, before its model: on a CPU its resident set; on CUDA the device
    memory in use (the context, the communicators' buffers and the caching allocator's reserve; on a shared GPU,
    other processes' too)."""
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        return total - free
    return psutil.Process().memory_info().rss


def cublas_workspace_bytes(device: torch.device) -> tuple[int, str]:
    """The bytes of cuBLAS workspaces a training step on ``device`` holds in CUDA's caching allocator, and how
    that was found, in words.

    torch gives each (cuBLAS handle, stream) a workspace from the caching allocator at its first matrix multiply
    and keeps it: inside ``max_memory_allocated``, outside the step's tensors. A step has two: the forward's thread
    and autograd's device thread have a handle each (32 MiB each on an H100 by default). Measured where this
    process has that GPU (the workspaces cleared, one product and its backward, the allocator's growth read, the
    workspaces cleared again and their memory given back); else ``STEP_BLAS_THREADS`` x
    ``ASSUMED_CUBLAS_WORKSPACE_BYTES``. 0 on a CPU.
    """
    if device.type != "cuda":
        return 0, "none on a CPU"
    clear = getattr(torch._C, "_cuda_clearCublasWorkspaces", None)
    if not torch.cuda.is_available() or clear is None:
        return (STEP_BLAS_THREADS * ASSUMED_CUBLAS_WORKSPACE_BYTES,
                f"assumed {STEP_BLAS_THREADS} x {ASSUMED_CUBLAS_WORKSPACE_BYTES // 2**20} MiB, torch's default on "
                "compute capability 9 and newer: no GPU here to measure it")
    device = torch.device("cuda", torch.cuda.current_device() if device.index is None else device.index)
    with torch.cuda.device(device):
        torch.cuda.synchronize()
        clear()
        before = torch.cuda.memory_allocated()
        a = torch.ones(64, 64, device=device, requires_grad=True)
        (a @ a).sum().backward()  # a product on this thread, and its gradients on autograd's device thread
        del a
        torch.cuda.synchronize()
        grown = torch.cuda.memory_allocated() - before
        # Leave no trace: the run's threads make their own at their first product, and the device's free memory,
        # which a budget reads, and the fixed cost, measured from it, stay as they were (nothing counted twice).
        clear()
        torch.cuda.empty_cache()
    return grown, f"measured: {grown / 2**20:.0f} MiB for the step's threads (one product forward and backward)"
