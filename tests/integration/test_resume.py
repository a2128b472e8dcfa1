"""Kill a run with SIGKILL mid-training, resume it, and get exactly the run that was never interrupted: every
step logged once, the same losses and learning rates, the same final weights. Dropout is on, so each rank's
RNG state must be restored for the masks after the resume to match.

Bit for bit: the resumed run and the uninterrupted one run on the same number of processes with the same batch,
so the same kernels add in the same order, from the exact saved state."""

from __future__ import annotations

import subprocess
import time
from pathlib import Path

import pytest
import torch
from finetune_runs import (
    DROPOUT,
    assert_only_complete_checkpoints,
    check_success,
    final_checkpoint,
    kill_tree,
    load_weights,
    logged_steps,
    run_tune_in_process,
    run_tune_subprocess,
    subprocess_env,
    tune_command,
    tune_run_argv,
)

from torchtune_ac.observability.metrics import read_metrics

EPOCHS, STEPS_PER_EPOCH, SAVE_EVERY = 3, 20, 5
TOTAL_STEPS = EPOCHS * STEPS_PER_EPOCH
# Killed once this step is logged: after two saves, mid-epoch, with 48 steps (seconds of work) of margin.
KILL_AFTER_STEP = 12
KILL_TIMEOUT_S = 240
# A save interrupted by the kill may leave this (the atomic writer's temporary name); the next save removes it.
DEBRIS = f".step_{TOTAL_STEPS:07d}.tmp-0123456789abcdef"
# The optimizer step in backward: its per-parameter optimizer states go through the checkpoint and come back.
IN_BACKWARD = ("optimizer_in_bwd=true", "clip_grad_norm=null")


def _resume_argv(output_dir: Path, nproc: int, *extra: str) -> list[str]:
    return tune_run_argv(
        output_dir,
        f"batch_size={4 // nproc}",
        f"epochs={EPOCHS}",
        f"max_steps_per_epoch={STEPS_PER_EPOCH}",
        f"save_every_n_steps={SAVE_EVERY}",
        *DROPOUT,
        *extra,
        nproc=nproc,
    )


def _start_and_kill(output_dir: Path, nproc: int, log: Path, *extra: str) -> int:
    """Start the run, SIGKILL it once step KILL_AFTER_STEP is logged; return the last step it logged."""
    with log.open("w") as stderr:
        process = subprocess.Popen(tune_command(_resume_argv(output_dir, nproc, *extra)), stdout=subprocess.DEVNULL,
                                   stderr=stderr, env=subprocess_env(), start_new_session=True)
    deadline = time.monotonic() + KILL_TIMEOUT_S
    try:
        while max(logged_steps(output_dir), default=0) < KILL_AFTER_STEP:
            if process.poll() is not None:
                pytest.fail(f"the run ended (exit {process.returncode}) before step {KILL_AFTER_STEP} was logged, "
                            f"so it could not be killed mid-run:\n{log.read_text()[-3000:]}")
            if time.monotonic() > deadline:
                pytest.fail(f"step {KILL_AFTER_STEP} not logged within {KILL_TIMEOUT_S} s")
            time.sleep(0.02)
    finally:
        kill_tree(process)
    last = logged_steps(output_dir)[-1]
    if last >= TOTAL_STEPS:
        pytest.fail(f"the run reached its last step {last} before it was killed")
    return last


def _check_kill_and_resume(tmp_path: Path, nproc: int, *extra: str) -> None:
    reference_dir, resumed_dir = tmp_path / "uninterrupted", tmp_path / "resumed"
    check_success(run_tune_subprocess(_resume_argv(reference_dir, nproc, *extra)))

    killed_at = _start_and_kill(resumed_dir, nproc, tmp_path / "killed.log", *extra)
    saved = assert_only_complete_checkpoints(resumed_dir, world_size=nproc)
    assert saved % SAVE_EVERY == 0 and SAVE_EVERY <= saved <= killed_at
    (resumed_dir / DEBRIS).mkdir()
    (resumed_dir / DEBRIS / "model.safetensors").write_bytes(b"half a file")

    result = run_tune_subprocess(_resume_argv(resumed_dir, nproc, *extra, "resume_from_checkpoint=true"))
    check_success(result)
    assert f"resumed from {resumed_dir / f'step_{saved:07d}'} at step {saved}" in result.stderr

    resumed, reference = read_metrics(resumed_dir), read_metrics(reference_dir)
    assert [r["step"] for r in resumed] == list(range(1, TOTAL_STEPS + 1))
    assert [r["step"] for r in reference] == list(range(1, TOTAL_STEPS + 1))
    for ours, expected in zip(resumed, reference):
        assert (ours["loss"], ours["lr"], ours["epoch"]) == (expected["loss"], expected["lr"], expected["epoch"])

    assert not (resumed_dir / DEBRIS).exists()
    assert assert_only_complete_checkpoints(resumed_dir, world_size=nproc) == TOTAL_STEPS
    ours, expected = load_weights(final_checkpoint(resumed_dir)), load_weights(final_checkpoint(reference_dir))
    assert all(torch.equal(ours[name], expected[name]) for name in expected)


@pytest.mark.slow
@pytest.mark.parametrize("extra", [(), IN_BACKWARD], ids=["step_after_backward", "step_in_backward"])
def test_killed_single_process_run_resumes_exactly(tmp_path: Path, extra: tuple[str, ...]) -> None:
    _check_kill_and_resume(tmp_path, 1, *extra)


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.parametrize("extra", [(), IN_BACKWARD], ids=["step_after_backward", "step_in_backward"])
def test_killed_two_process_run_resumes_exactly(tmp_path: Path, extra: tuple[str, ...]) -> None:
    _check_kill_and_resume(tmp_path, 2, *extra)


def test_a_longer_resumed_run_takes_its_first_step_at_the_new_schedules_rate(tmp_path):
    # The README's way to train more: raise epochs and resume. The checkpoint holds the rate the 6-step schedule
    # reached at its end (0.0); the resumed step 7 must use the 12-step schedule's rate, as a 12-step run does.
    schedule = ("max_steps_per_epoch=6", "lr_scheduler.num_warmup_steps=2")
    out, reference = tmp_path / "resumed", tmp_path / "reference"
    check_success(run_tune_in_process(tune_run_argv(out, *schedule, "epochs=1")))
    check_success(run_tune_in_process(tune_run_argv(out, *schedule, "epochs=2", "resume_from_checkpoint=true")))
    check_success(run_tune_in_process(tune_run_argv(reference, *schedule, "epochs=2")))
    resumed = {row["step"]: row["lr"] for row in read_metrics(out)}
    expected = {row["step"]: row["lr"] for row in read_metrics(reference)}
    assert sorted(resumed) == list(range(1, 13))
    assert resumed[7] > 0
    assert [resumed[step] for step in range(7, 13)] == [expected[step] for step in range(7, 13)]
