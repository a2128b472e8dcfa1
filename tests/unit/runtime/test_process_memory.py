"""The process's own memory: what it holds before the model (measured), and glibc set to give freed tensors back,
so that a CPU run's resident memory follows its live tensors as the planner counts them."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import psutil
import pytest
import torch

from torchtune_ac.runtime.process_memory import fixed_bytes

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


def test_the_fixed_cost_on_a_cpu_is_the_resident_set():
    assert abs(fixed_bytes(torch.device("cpu")) - psutil.Process().memory_info().rss) < 2**26


def test_a_cpu_plan_counts_the_resident_set_and_what_a_stepping_process_adds():
    from torchtune_ac.run.plan import process_fixed_bytes
    from torchtune_ac.config.schema import Device
    from torchtune_ac.runtime.process_memory import CPU_STEP_RUNTIME_BYTES

    counted, how = process_fixed_bytes(Device.CPU)
    assert abs(counted - CPU_STEP_RUNTIME_BYTES - psutil.Process().memory_info().rss) < 2**26
    assert "GiB for what a CPU process adds once it steps" in how
