"""HSDP (``fsdp.replicate_degree``): 4 processes as 2 replicas x 2 shards train as 1 process does on the same global
batch, and the checkpoint they write resumes on another mesh (2 processes, plain FSDP) through DCP.

Each of the 4 ranks reads its own quarter of every global batch (the data-parallel world is every rank, whatever
the mesh), so the runs are comparable step for step (fp32, shuffle on, dropout off). They add in other orders
(gloo's reduce-scatter within a row, then the all-reduce across rows), so they agree within rounding as
``numerics`` bounds it for training runs; the issue's target, 1e-5 on the loss, is checked besides: the
arithmetic-derived bound is the looser of the two here (about 5e-4 at these losses of about 6; measured: the
losses of the 2 x 2 run differ from 1 process's by at most 5.1e-7, its gradient norms by at most 1.2e-5).
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from finetune_runs import check_success, run_tune_in_process, run_tune_subprocess, tune_run_argv
from numerics import assert_steps_alike, llama_terms

from torchtune_ac.checkpoint import list_checkpoints
from torchtune_ac.models.families.llama import LLAMA_TINY
from torchtune_ac.observability.metrics import read_metrics

STEPS = 4
GLOBAL_BATCH = 4
TERMS = llama_terms(LLAMA_TINY, 64, GLOBAL_BATCH * 64)
ISSUE_TARGET = 1e-5


def _argv(output_dir: Path, *overrides: str, nproc: int) -> list[str]:
    return tune_run_argv(output_dir, f"max_steps_per_epoch={STEPS}", f"batch_size={GLOBAL_BATCH // nproc}",
                         "save_every_n_steps=2", *overrides, nproc=nproc)


@pytest.mark.slow
@pytest.mark.distributed
def test_hsdp_2x2_trains_as_one_process_and_resumes_on_2_processes(tmp_path: Path) -> None:
    one_dir, hsdp_dir = tmp_path / "one", tmp_path / "hsdp"
    check_success(run_tune_in_process(_argv(one_dir, nproc=1)))
    result = run_tune_subprocess(_argv(hsdp_dir, "fsdp.replicate_degree=2", nproc=4))
    check_success(result)
    assert "HSDP: 2 replicas x 2 shards" in result.stderr
    one, hsdp = read_metrics(one_dir), read_metrics(hsdp_dir)
    assert [r["step"] for r in hsdp] == list(range(1, STEPS + 1)), "rank 0 alone logs each step once"
    for a, b in zip(hsdp, one):
        assert a["target_tokens"] == b["target_tokens"], (a, b)  # the same samples made each step
    for name in ("loss", "grad_norm"):
        assert_steps_alike([r[name] for r in hsdp], [r[name] for r in one], terms=TERMS, what=name)
    assert max(abs(a["loss"] - b["loss"]) for a, b in zip(hsdp, one)) <= ISSUE_TARGET

    # The 2 x 2 run's step-2 checkpoint resumes on 2 processes sharding over both (another mesh shape).
    shutil.rmtree(list_checkpoints(hsdp_dir)[-1])
    resumed = run_tune_subprocess(_argv(hsdp_dir, "resume_from_checkpoint=true", nproc=2))
    check_success(resumed)
    assert "resharded from 4 process(es) to 2" in resumed.stderr
    after = read_metrics(hsdp_dir)
    assert [r["step"] for r in after] == list(range(1, STEPS + 1))
    for name in ("loss", "grad_norm"):
        assert_steps_alike([r[name] for r in after], [r[name] for r in one], terms=TERMS, what=name)
