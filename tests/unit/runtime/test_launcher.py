"""The launcher gives each worker its share of the cores unless the user chose (OMP_NUM_THREADS)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch.distributed.run

from torchtune_ac.runtime import launcher


@pytest.mark.parametrize("cores, nproc, threads", [(8, 4, 2), (2, 4, 1), (16, 1, 16), (5, 2, 2)])
def test_each_worker_gets_the_cores_divided_by_the_processes(monkeypatch, cores, nproc, threads):
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(cores)))
    assert launcher.threads_per_process({"nproc_per_node": nproc}) == threads


@pytest.mark.parametrize("given, expected", [(None, "2"), ("3", "3")])
def test_the_workers_environment_has_the_threads_unless_the_user_set_them(monkeypatch, tmp_path: Path, given, expected):
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(8)))
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
    assert launcher.REPORTS_ENV_VAR not in os.environ
