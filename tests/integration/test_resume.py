"""Kill a run with SIGKILL mid-training, resume it, and get exactly the run that was never interrupted: every
step logged once, the same losses and learning rates, the same final weights. Dropout is on, so each rank's
RNG state must be restored for the masks after the resume to match.

Bit for bit: the resumed run and the uninterrupted one run on the same number of processes with the same batch,
so the same kernels add in the same order, from the exact saved state.

With torchao's 8-bit AdamW (whose quantized state goes through DCP as codes and scales) the same holds on 1 and 2
processes, also with the step in backward; and a checkpoint of 2 processes resumes on 1. These runs are shorter
(8 steps, no dropout): torchao's step is slower, and its first one compiles."""

from __future__ import annotations

import hashlib
import json
import logging
import shutil
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from finetune_runs import (
    DROPOUT,
    assert_only_complete_checkpoints,
    check_success,
    final_checkpoint,
    hash_tree,
    kill_tree,
    load_weights,
    logged_steps,
    run_tune_in_process,
    run_tune_subprocess,
    subprocess_env,
    tune_command,
    tune_run_argv,
)

from torchtune_ac.checkpoint import list_checkpoints
from torchtune_ac.checkpoint.manifest import write_manifest
from torchtune_ac.data import EMBEDDED_INSTRUCT_PATH
from torchtune_ac.observability.metrics import read_metrics

KILL_TIMEOUT_S = 240
# The optimizer step in backward: its per-parameter optimizer states go through the checkpoint and come back.
IN_BACKWARD = ("optimizer_in_bwd=true", "clip_grad_norm=null")
EIGHT_BIT = ("optimizer._component_=torchao.optim.AdamW8bit",)


@dataclass(frozen=True)
class Schedule:
    """A run's length and saves, and the step after which it is killed."""

    epochs: int
    steps_per_epoch: int
    save_every: int
    kill_after: int
    dropout: bool = True

    @property
    def total_steps(self) -> int:
        return self.epochs * self.steps_per_epoch


# Killed after two saves, mid-epoch (the resumed run then crosses an epoch boundary), with 22 steps and 4 saves
# (seconds of work) of margin.
LONG = Schedule(epochs=2, steps_per_epoch=16, save_every=4, kill_after=10)
# torchao's runs: killed after the first save, with 5 steps of margin (each a few seconds).
SHORT = Schedule(epochs=2, steps_per_epoch=4, save_every=2, kill_after=3, dropout=False)


def _debris(schedule: Schedule) -> str:
    """A name a save interrupted by the kill may leave (the atomic writer's temporary name); the next save removes
    it."""
    return f".step_{schedule.total_steps:07d}.tmp-0123456789abcdef"


def _resume_argv(output_dir: Path, nproc: int, schedule: Schedule, *extra: str) -> list[str]:
    return tune_run_argv(
        output_dir,
        f"batch_size={4 // nproc}",
        f"epochs={schedule.epochs}",
        f"max_steps_per_epoch={schedule.steps_per_epoch}",
        f"save_every_n_steps={schedule.save_every}",
        *(DROPOUT if schedule.dropout else ()),
        *extra,
        nproc=nproc,
    )


def _start_and_kill(output_dir: Path, nproc: int, schedule: Schedule, log: Path, *extra: str) -> int:
    """Start the run, SIGKILL it once step ``schedule.kill_after`` is logged; return the last step it logged."""
    with log.open("w") as stderr:
        process = subprocess.Popen(tune_command(_resume_argv(output_dir, nproc, schedule, *extra)),
                                   stdout=subprocess.DEVNULL, stderr=stderr, env=subprocess_env(),
                                   start_new_session=True)
    deadline = time.monotonic() + KILL_TIMEOUT_S
    try:
        while max(logged_steps(output_dir), default=0) < schedule.kill_after:
            if process.poll() is not None:
                pytest.fail(f"the run ended (exit {process.returncode}) before step {schedule.kill_after} was logged, "
                            f"so it could not be killed mid-run:\n{log.read_text()[-3000:]}")
            if time.monotonic() > deadline:
                pytest.fail(f"step {schedule.kill_after} not logged within {KILL_TIMEOUT_S} s")
            time.sleep(0.02)
    finally:
        kill_tree(process)
    last = logged_steps(output_dir)[-1]
    if last >= schedule.total_steps:
        pytest.fail(f"the run reached its last step {last} before it was killed")
    return last


def _check_kill_and_resume(tmp_path: Path, nproc: int, *extra: str, schedule: Schedule = LONG) -> str:
    """Kill and resume a run, check it against the uninterrupted one; returns what the resumed run printed."""
    reference_dir, resumed_dir = tmp_path / "uninterrupted", tmp_path / "resumed"
    check_success(run_tune_subprocess(_resume_argv(reference_dir, nproc, schedule, *extra)))

    killed_at = _start_and_kill(resumed_dir, nproc, schedule, tmp_path / "killed.log", *extra)
    saved = assert_only_complete_checkpoints(resumed_dir, world_size=nproc)
    assert saved % schedule.save_every == 0 and schedule.save_every <= saved <= killed_at
    debris = resumed_dir / _debris(schedule)
    debris.mkdir()
    (debris / "model.safetensors").write_bytes(b"half a file")

    result = run_tune_subprocess(_resume_argv(resumed_dir, nproc, schedule, *extra, "resume_from_checkpoint=true"))
    check_success(result)
    assert f"resumed from {resumed_dir / f'step_{saved:07d}'} at step {saved}" in result.stderr

    resumed, reference = read_metrics(resumed_dir), read_metrics(reference_dir)
    assert [r["step"] for r in resumed] == list(range(1, schedule.total_steps + 1))
    assert [r["step"] for r in reference] == list(range(1, schedule.total_steps + 1))
    for ours, expected in zip(resumed, reference):
        assert (ours["loss"], ours["lr"], ours["epoch"]) == (expected["loss"], expected["lr"], expected["epoch"])

    assert not debris.exists()
    assert assert_only_complete_checkpoints(resumed_dir, world_size=nproc) == schedule.total_steps
    ours, expected = load_weights(final_checkpoint(resumed_dir)), load_weights(final_checkpoint(reference_dir))
    assert all(torch.equal(ours[name], expected[name]) for name in expected)
    return result.stderr


# The step in backward is killed and resumes exactly on 2 processes in the 8-bit test below, whose state saved by
# 2 processes also resumes on 1; AdamW's own per-parameter states in backward go through DCP on 2 processes and
# back in tests/unit/checkpoint/test_distributed_checkpoint.py. The checkpoint's code is the same for 1 process
# (DCP without a process group). So the runs here, 1 and 2 processes with dropout, step after backward.
@pytest.mark.slow
def test_killed_single_process_run_resumes_exactly(tmp_path: Path) -> None:
    _check_kill_and_resume(tmp_path, 1)


@pytest.mark.slow
@pytest.mark.distributed
def test_killed_two_process_run_resumes_exactly(tmp_path: Path) -> None:
    _check_kill_and_resume(tmp_path, 2)


def test_a_longer_resumed_run_takes_its_first_step_at_the_new_schedules_rate(tmp_path):
    # The way docs/checkpoints.md gives to train more: raise epochs and resume. The checkpoint holds the rate the
    # 6-step schedule reached at its end (0.0); the resumed step 7 must use the 12-step schedule's rate, as a 12-step
    # run does.
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


def test_a_resume_takes_the_learning_rate_and_schedule_of_its_config_and_says_what_changed(tmp_path, caplog):
    # The case: steps 4-6 trained at the checkpoint's 3e-3, and the cosine schedule kept its base rate.
    caplog.set_level(logging.INFO)
    resume = "resume_from_checkpoint=true"
    for schedule in (("lr_scheduler=null",), ("lr_scheduler.num_warmup_steps=1",)):
        out, reference = tmp_path / f"resumed{len(caplog.records)}", tmp_path / f"reference{len(caplog.records)}"
        changed = ("optimizer.lr=1e-5", "optimizer.weight_decay=0.1", "epochs=2")
        check_success(run_tune_in_process(tune_run_argv(out, "max_steps_per_epoch=3", *schedule)))
        caplog.clear()
        check_success(run_tune_in_process(tune_run_argv(out, "max_steps_per_epoch=3", *schedule, *changed, resume)))
        (line,) = [r.getMessage() for r in caplog.records if r.getMessage().startswith("resume with other settings")]
        assert line == ("resume with other settings: optimizer.lr: 0.003 in step_0000003, 1e-05 now; "
                        "optimizer.weight_decay: 0.01 in step_0000003, 0.1 now (the optimizer state carries over; the "
                        "hyper-parameters and the schedule are this config's)")
        check_success(run_tune_in_process(tune_run_argv(reference, "max_steps_per_epoch=3", *schedule, *changed)))
        resumed = {row["step"]: row["lr"] for row in read_metrics(out)}
        expected = {row["step"]: row["lr"] for row in read_metrics(reference)}
        assert [resumed[step] for step in (4, 5, 6)] == [expected[step] for step in (4, 5, 6)]
        assert resumed[4] != resumed[3] and resumed[4] <= 1e-5


def test_a_checkpoint_of_an_earlier_version_still_resumes_and_says_its_data_is_unchecked(tmp_path, caplog):
    """Earlier versions recorded neither the hyper-parameters nor the data in trainer_state.json: a run they left
    half-way resumes as before, exactly, saying once that the data cannot be checked."""
    caplog.set_level(logging.INFO)
    out, reference = tmp_path / "resumed", tmp_path / "reference"
    check_success(run_tune_in_process(tune_run_argv(out, "max_steps_per_epoch=3")))
    state_file = out / "step_0000003" / "recipe_state" / "trainer_state.json"
    record = json.loads(state_file.read_text())
    state_file.write_text(json.dumps({"progress": record["progress"], "shape": record["shape"]}))
    write_manifest(out / "step_0000003")  # as that version wrote it: the manifest matches the file
    caplog.clear()
    check_success(run_tune_in_process(tune_run_argv(out, "max_steps_per_epoch=3", "epochs=2",
                                                    "resume_from_checkpoint=true")))
    warnings = [r.getMessage() for r in caplog.records if "records no identity of its data" in r.getMessage()]
    assert warnings == ["step_0000003 records no identity of its data (an earlier version wrote it): the data "
                        "cannot be checked against the checkpoint's"]
    check_success(run_tune_in_process(tune_run_argv(reference, "max_steps_per_epoch=3", "epochs=2")))
    assert [r["loss"] for r in read_metrics(out)] == [r["loss"] for r in read_metrics(reference)]


def test_a_resume_checks_its_data_by_content_not_by_path(tmp_path):
    # It was the wrong way round: a file cut to a third resumed without a word, the same file renamed was refused.
    data, moved = tmp_path / "a.jsonl", tmp_path / "moved" / "b.jsonl"
    lines = Path(EMBEDDED_INSTRUCT_PATH).read_text().splitlines(keepends=True)
    data.write_text("".join(lines))
    out, reference = tmp_path / "resumed", tmp_path / "reference"
    check_success(run_tune_in_process(tune_run_argv(out, "max_steps_per_epoch=3", f"dataset.source={data}")))
    moved.parent.mkdir()
    data.rename(moved)
    resume = (f"dataset.source={moved}", "epochs=2", "resume_from_checkpoint=true")
    check_success(run_tune_in_process(tune_run_argv(out, "max_steps_per_epoch=3", *resume)))
    check_success(run_tune_in_process(tune_run_argv(reference, "max_steps_per_epoch=3", "epochs=2")))
    assert [r["loss"] for r in read_metrics(out)] == [r["loss"] for r in read_metrics(reference)]

    for changed in ("".join(lines[:1000]), "".join(lines[1000:1120]) + "".join(lines[120:3000])):
        moved.write_text(changed)  # cut to a third; 120 records replaced by others, as many in all
        before = hash_tree(out)
        result = run_tune_in_process(tune_run_argv(out, "max_steps_per_epoch=3", *resume[:1], "epochs=3",
                                                   "resume_from_checkpoint=true"))
        assert result.returncode == 2, result.stderr
        (line,) = [line for line in result.stderr.splitlines() if line.strip()]
        assert line.startswith(f"tune: error: resume from {out / 'step_0000006'}: the training data changed since "
                               f"that checkpoint ({moved}: "), line
        assert line.endswith(f"start a new run with checkpoint_dir={out / 'step_0000006'} and another output_dir")
        assert hash_tree(out) == before


def test_a_resume_from_a_list_of_sources_refuses_when_one_of_its_files_changed(tmp_path):
    """``source: [a, b]``: the checkpoint records both files; ``b`` rewritten with its records in another order (as
    many samples, so the count cannot tell) is refused, naming ``b`` alone."""
    lines = Path(EMBEDDED_INSTRUCT_PATH).read_bytes().splitlines(keepends=True)
    a, b, out = tmp_path / "a.jsonl", tmp_path / "b.jsonl", tmp_path / "run"
    a.write_bytes(b"".join(lines[:1500]))
    b.write_bytes(b"".join(lines[1500:]))
    run = ("max_steps_per_epoch=2", f"dataset.source=[{a},{b}]")
    check_success(run_tune_in_process(tune_run_argv(out, *run)))
    was, now = b.read_bytes(), b"".join(reversed(lines[1500:]))
    b.write_bytes(now)
    before = hash_tree(out)
    result = run_tune_in_process(tune_run_argv(out, *run, "epochs=2", "resume_from_checkpoint=true"))
    assert result.returncode == 2, result.stderr
    (line,) = [line for line in result.stderr.splitlines() if line.strip()]
    checkpoint = out / "step_0000002"
    short = [hashlib.sha256(content).hexdigest()[:12] for content in (was, now)]
    assert line == (f"tune: error: resume from {checkpoint}: the training data changed since that checkpoint ({b}: "
                    f"{len(was):,} bytes (sha256 {short[0]}) in step_0000002, {len(now):,} bytes (sha256 {short[1]}) "
                    "now), so the run cannot continue exactly; to train on from its weights with this data, start a "
                    f"new run with checkpoint_dir={checkpoint} and another output_dir")
    assert hash_tree(out) == before


@pytest.mark.slow
@pytest.mark.distributed
def test_on_two_processes_a_new_learning_rate_is_said_once_and_changed_data_refused_once(tmp_path):
    data, out = tmp_path / "a.jsonl", tmp_path / "run"
    lines = Path(EMBEDDED_INSTRUCT_PATH).read_text().splitlines(keepends=True)
    data.write_text("".join(lines))
    run = ("max_steps_per_epoch=2", "batch_size=2", "lr_scheduler=null", f"dataset.source={data}")
    check_success(run_tune_subprocess(tune_run_argv(out, *run, nproc=2)))
    result = run_tune_subprocess(tune_run_argv(out, *run, "epochs=2", "optimizer.lr=1e-5", "resume_from_checkpoint=true",
                                               nproc=2))
    check_success(result)
    assert result.stderr.count("resume with other settings: optimizer.lr: 0.003 in step_0000002, 1e-05 now") == 1
    assert [r["lr"] for r in read_metrics(out)] == [0.003, 0.003, 1e-5, 1e-5]

    data.write_text("".join(lines[:1000]))
    result = run_tune_subprocess(tune_run_argv(out, *run, "epochs=3", "resume_from_checkpoint=true", nproc=2))
    assert result.returncode == 2, result.stderr
    errors = [line for line in result.stderr.splitlines() if line.startswith("tune: error: ")]
    assert len(errors) == 1 and "the training data changed since that checkpoint" in errors[0], result.stderr
    assert "[rank" not in result.stderr and "Traceback" not in result.stderr, result.stderr


@pytest.mark.slow
def test_killed_single_process_run_with_8_bit_adamw_resumes_exactly(tmp_path: Path) -> None:
    printed = _check_kill_and_resume(tmp_path, 1, *EIGHT_BIT, schedule=SHORT)
    # The resume's compile (at the state's first load) is announced, once, instead of passing in silence.
    assert printed.count("torchao.optim.AdamW8bit: compiling its update for each parameter shape") == 1, printed


# A 2 -> 1 resume meets the same state in other shards (and blocks of the quantization): its losses follow the
# 2-process run's closely, not exactly. What fresh optimizer state gives instead differs by far more.
RESHARDED_LOSS_RTOL = 1e-3


@pytest.mark.slow
@pytest.mark.distributed
def test_killed_two_process_run_with_8_bit_adamw_in_backward_resumes_exactly_and_on_one_process(tmp_path: Path) -> None:
    _check_kill_and_resume(tmp_path, 2, *EIGHT_BIT, *IN_BACKWARD, schedule=SHORT)
    # The reference run's newest checkpoint goes; its previous one (2 processes) resumes on 1.
    reference_dir = tmp_path / "uninterrupted"
    two_processes = read_metrics(reference_dir)
    newest, previous = list_checkpoints(reference_dir)[-1], list_checkpoints(reference_dir)[-2]
    shutil.rmtree(newest)
    saved = int(previous.name.removeprefix("step_"))
    result = run_tune_subprocess(_resume_argv(reference_dir, 1, SHORT, *EIGHT_BIT, *IN_BACKWARD,
                                              "resume_from_checkpoint=true"))
    check_success(result)
    assert f"resumed from {previous} at step {saved}" in result.stderr
    assert "resharded from 2 process(es) to 1" in result.stderr
    one_process = read_metrics(reference_dir)
    assert [r["step"] for r in one_process] == list(range(1, SHORT.total_steps + 1))
    for ours, expected in zip(one_process[saved:], two_processes[saved:]):
        assert abs(ours["loss"] - expected["loss"]) <= RESHARDED_LOSS_RTOL * abs(expected["loss"]), (ours, expected)
