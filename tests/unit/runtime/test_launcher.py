"""The launcher gives each worker its share of the cores unless the user chose (OMP_NUM_THREADS); how the share is
decided is ``tests/unit/runtime/test_cpu_threads.py``'s."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch.distributed.run

from torchtune_ac.runtime import cpu_threads, launcher


@pytest.mark.parametrize("given, expected", [(None, "2"), ("3", "3")])
def test_the_workers_environment_has_the_threads_unless_the_user_set_them(monkeypatch, tmp_path: Path, given, expected):
    monkeypatch.setattr(cpu_threads, "read_cpu_view", lambda: cpu_threads.CpuView(8))
    monkeypatch.setenv(cpu_threads.DECIDED_VAR, "")
    monkeypatch.delenv(cpu_threads.DECIDED_VAR)
    if given is None:
        monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    else:
        monkeypatch.setenv("OMP_NUM_THREADS", given)
    seen = {}
    monkeypatch.setattr(torch.distributed.run, "run", lambda args: seen.update(
        threads=os.environ.get("OMP_NUM_THREADS"), reports=os.environ.get(launcher.REPORTS_ENV_VAR)))
    assert launcher.launch_elastic({"nproc_per_node": 4}, tmp_path / "recipe.py", []) == 0
    assert seen["threads"] == expected and seen["reports"]
    assert os.environ.get("OMP_NUM_THREADS") == given  # the launcher's own environment is left as it was
    assert launcher.REPORTS_ENV_VAR not in os.environ and cpu_threads.DECIDED_VAR not in os.environ
