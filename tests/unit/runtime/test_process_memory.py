"""The process's own memory: what it holds before the model (measured), and glibc set either to give freed tensors
back, so that a CPU run's resident memory follows its live tensors as the planner counts them, or to keep them for
the next step."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import psutil
import pytest
import torch

from torchtune_ac.runtime.process_memory import fixed_bytes
from torchtune_ac.runtime.parallelism import Parallelism

# Half of 300 tensors of 1 MiB freed, every other one: the heap's holes stay resident under glibc's defaults (its
# threshold has risen past 1 MiB at the first free of a mapped 1 MiB block), and go back with follow_live_tensors.
FRAGMENT = textwrap.dedent("""
    import json, sys, psutil, torch
    from torchtune_ac.runtime.process_memory import follow_live_tensors
    applied = follow_live_tensors() if sys.argv[1] == "set" else False
    first = torch.empty(2**18)  # 1 MiB: mapped, then freed (glibc raises its threshold past it by default)
    del first
    before = psutil.Process().memory_info().rss
    tensors = [torch.ones(2**18) for _ in range(300)]
    del tensors[::2]
    print(json.dumps({"applied": applied, "kept": (psutil.Process().memory_info().rss - before) / 2**20}))
""")


def _kept_mib(mode: str) -> dict:
    out = subprocess.run([sys.executable, "-c", FRAGMENT, mode], capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt")
def test_freed_tensors_go_back_to_the_system_once_set():
    default, followed = _kept_mib("default"), _kept_mib("set")
    assert followed["applied"] is True and default["applied"] is False
    assert default["kept"] > 250  # 150 MiB alive and 150 MiB of holes
    assert followed["kept"] < 200  # the 150 MiB alive (and a little)


# A step's worth of 1 MiB tensors freed, as each training step frees what it allocated: under glibc's defaults the
# free top of the heap goes back to the system (and the next step faults it in again); keep_freed_memory keeps it.
# Read as the resident set rather than page faults, which transparent huge pages would count otherwise.
REFREED = textwrap.dedent("""
    import json, sys, psutil, torch
    from torchtune_ac.runtime.process_memory import keep_freed_memory
    applied = keep_freed_memory() if sys.argv[1] == "keep" else False
    tensors = [torch.ones(2**18) for _ in range(200)]  # 200 MiB, written: resident
    held = psutil.Process().memory_info().rss
    del tensors
    print(json.dumps({"applied": applied, "given_back": (held - psutil.Process().memory_info().rss) / 2**20}))
""")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt")
def test_freed_memory_is_kept_for_the_next_step_and_a_users_malloc_settings_are_left_alone():
    def run(mode, **env):
        out = subprocess.run([sys.executable, "-c", REFREED, mode], capture_output=True, text=True, check=True,
                             env={k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")} | env)
        return json.loads(out.stdout.strip().splitlines()[-1])

    default, kept = run("default"), run("keep")
    assert default["applied"] is False and kept["applied"] is True
    assert default["given_back"] > 150  # the 200 MiB, unmapped or trimmed
    assert kept["given_back"] < 20  # kept for reuse
    assert run("keep", MALLOC_TRIM_THRESHOLD_="131072")["applied"] is False


def test_the_fixed_cost_on_a_cpu_is_the_resident_set():
    assert abs(fixed_bytes(torch.device("cpu")) - psutil.Process().memory_info().rss) < 2**26


def test_a_cpu_plan_counts_the_resident_set_and_what_a_stepping_process_adds():
    from torchtune_ac.run.plan import process_fixed_bytes
    from torchtune_ac.config.schema import Device
    from torchtune_ac.runtime.process_memory import CPU_STEP_RUNTIME_BYTES

    counted, how = process_fixed_bytes(Device.CPU)
    assert abs(counted - CPU_STEP_RUNTIME_BYTES - psutil.Process().memory_info().rss) < 2**26
    assert "GiB for what a CPU process adds once it steps" in how


def test_the_cublas_workspaces_are_none_on_a_cpu_and_assumed_where_no_gpu_can_be_asked(monkeypatch):
    from torchtune_ac.runtime.process_memory import (
        ASSUMED_CUBLAS_WORKSPACE_BYTES,
        STEP_BLAS_THREADS,
        cublas_workspace_bytes,
    )

    assert cublas_workspace_bytes(torch.device("cpu")) == (0, "none on a CPU")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    counted, how = cublas_workspace_bytes(torch.device("cuda"))
    assert counted == STEP_BLAS_THREADS * ASSUMED_CUBLAS_WORKSPACE_BYTES == 64 * 2**20
    assert how.startswith("assumed 2 x 32 MiB")


def test_a_cuda_plan_counts_the_cublas_workspaces_in_its_transient_memory(monkeypatch):
    """The same config planned for CUDA and for a CPU: the step differs by the two workspaces, in ``transient``;
    and tune plan's legend says where they come from."""
    import dataclasses

    from torchtune_ac.cli import load_recipe, load_recipe_config, resolve_recipe_path
    from torchtune_ac.memory.planner import estimate_memory
    from torchtune_ac.run.plan import planner_inputs
    from torchtune_ac.activation_checkpointing.config import resolve_ac_plan

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # planned here for a GPU elsewhere
    recipe = load_recipe(resolve_recipe_path("full_finetune"))
    estimates = {}
    for device in ("cuda", "cpu"):
        cfg = load_recipe_config(recipe, "tiny/full", [f"device={device}", "max_seq_len=64", "batch_size=2"], [])
        inputs = planner_inputs(cfg, Parallelism(1), torch.device("cpu"))
        plan = resolve_ac_plan(enable_activation_checkpointing=None, ac_mode="full", ac_option=None, n_layers=8)
        (estimates[device],) = estimate_memory(inputs.build_model, inputs.make_optimizer, inputs.workload, [plan])
        assert inputs.workload.blas_workspaces == (64 * 2**20 if device == "cuda" else 0)
    difference = {field.name: getattr(estimates["cuda"], field.name) - getattr(estimates["cpu"], field.name)
                  for field in dataclasses.fields(estimates["cpu"]) if field.name in (
                      "parameters", "optimizer", "gradients", "activations", "transient")}
    assert difference == {"parameters": 0, "optimizer": 0, "gradients": 0, "activations": 0,
                          "transient": 64 * 2**20}
    cfg = load_recipe_config(recipe, "tiny/full", ["device=cuda", "max_seq_len=64", "batch_size=2"], [])
    legend = "\n".join(recipe.plan(cfg, world_size=1, budget_gib=None).lines())
    assert "cuBLAS's workspaces (assumed 2 x 32 MiB, torch's default on compute capability 9 and newer" in legend
