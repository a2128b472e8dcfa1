"""What the planner counts on CUDA besides the step's tensors: the cuBLAS workspaces of the step's two threads
(``runtime.process_memory.cublas_workspace_bytes``), measured without leaving anything allocated or reserved."""

from __future__ import annotations

import os

import torch

from torchtune_ac.runtime.process_memory import (
    ASSUMED_CUBLAS_WORKSPACE_BYTES,
    STEP_BLAS_THREADS,
    cublas_workspace_bytes,
)


def test_the_cublas_workspaces_are_measured_and_leave_no_trace():
    torch.cuda.synchronize()
    torch._C._cuda_clearCublasWorkspaces()  # those of the tests before, in this process
    torch.cuda.empty_cache()
    allocated, reserved = torch.cuda.memory_allocated(), torch.cuda.memory_reserved()
    measured, how = cublas_workspace_bytes(torch.device("cuda"))
    print(f"cuBLAS workspaces: {measured / 2**20:.2f} MiB ({how})")
    assert how.startswith("measured")
    if torch.cuda.get_device_capability()[0] >= 9 and "CUBLAS_WORKSPACE_CONFIG" not in os.environ:
        # torch's default on Hopper and newer, one workspace per thread: what the planner assumes without a GPU.
        assert measured == STEP_BLAS_THREADS * ASSUMED_CUBLAS_WORKSPACE_BYTES
    else:
        assert measured > 0
    assert (torch.cuda.memory_allocated(), torch.cuda.memory_reserved()) == (allocated, reserved)
