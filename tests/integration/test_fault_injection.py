"""Fault injection through the real ``tune`` command: how multi-day runs die, and what survives.

Every run here is the same 12-step run of the embedded model with a global batch of 4 samples (split over 1 or 2
processes), saving every 3 steps, without dropout; one uninterrupted run in one process is the reference. Each
fault is injected, the run resumed (on the same or another number of processes), and the result compared with
the reference step by step: every step logged once, the same learning rates, and the same losses and final
weights: bit for bit where every part ran on 1 process with the reference's batch (the same kernels in the same
order, from the exact saved state), within rounding (``numerics``) where 2 processes or micro-batches add in
another order.

Faults: SIGTERM through ``tune run`` on 2 and on 1 process(es) (exit 143, one line on how to resume), a first
Ctrl-C and a second one (abort at once), SIGKILL during a save and at a random step, a non-finite loss (injected
into one micro-batch) and a diverging learning rate, a damaged checkpoint, a full disk during a save, and the
dead ends: a run that crashed before its first checkpoint, a tokenizer larger than the model's vocabulary, a
checkpoint_dir of another shape, an optimizer argument the class rejects, nodes given different configs, and
``tune validate`` writing the embedded checkpoint. Bounded: each subprocess has a deadline, and the module takes
about a minute on 2 cores.
"""

from __future__ import annotations

import json
import logging
import random
import re
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path
from typing import Callable

import pyarrow
import pyarrow.parquet
import pytest
import torch
from finetune_runs import (
    SHORT_RUN,
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
from numerics import assert_steps_alike, assert_weights_trained_alike, llama_terms

from torchtune_ac.checkpoint import RECIPE_STATE_DIR, list_checkpoints, safetensors_io
from torchtune_ac.checkpoint.manifest import check_against_manifest
from torchtune_ac.embedded import CACHE_ENV_VAR
from torchtune_ac.models.families.llama import LLAMA_TINY
from torchtune_ac.observability.metrics import read_metrics
from torchtune_ac.training import step as step_module

STEPS, SAVE_EVERY, GLOBAL_BATCH = 12, 3, 4
# A step's global batch: 4 rows of 64 tokens (SHORT_RUN's max_seq_len).
TERMS = llama_terms(LLAMA_TINY, 64, GLOBAL_BATCH * 64)
DEADLINE_S = 180
EXIT_STOPPED, EXIT_NON_FINITE, EXIT_INTERRUPTED = 143, 3, 130


def _argv(output_dir: Path, *extra: str, nproc: int = 1) -> list[str]:
    return tune_run_argv(output_dir, f"max_steps_per_epoch={STEPS}", f"save_every_n_steps={SAVE_EVERY}",
                         f"batch_size={GLOBAL_BATCH // nproc}", *extra, nproc=nproc)


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The uninterrupted run, in one process."""
    output_dir = tmp_path_factory.mktemp("faults") / "reference"
    check_success(run_tune_in_process(_argv(output_dir)))
    return output_dir


def _assert_same_run(output_dir: Path, reference: Path, *, exact: bool) -> None:
    """The run in ``output_dir`` is the reference run: bit for bit (``exact``: every part ran on 1 process with
    the reference's batch), or within rounding of training runs that add in another order."""
    ours, expected = read_metrics(output_dir), read_metrics(reference)
    assert [r["step"] for r in ours] == list(range(1, STEPS + 1)), "every step logged once"
    for a, b in zip(ours, expected):
        assert a["lr"] == b["lr"] and a["target_tokens"] == b["target_tokens"], (a, b)  # Python arithmetic, ints
    weights, expected_weights = load_weights(final_checkpoint(output_dir)), load_weights(final_checkpoint(reference))
    if exact:
        assert [(r["loss"], r["grad_norm"]) for r in ours] == [(r["loss"], r["grad_norm"]) for r in expected]
        assert all(torch.equal(weights[name], expected_weights[name]) for name in expected_weights)
        return
    for name in ("loss", "grad_norm"):
        assert_steps_alike([r[name] for r in ours], [r[name] for r in expected], terms=TERMS, what=name)
    assert_weights_trained_alike(weights, expected_weights, lrs=[r["lr"] for r in expected], terms=TERMS)


def _ours(stderr: str) -> list[str]:
    """Our lines (the elastic launcher adds log lines of its own)."""
    return [line for line in stderr.splitlines() if line.startswith("tune:")]


def _start(argv: list[str], log: Path) -> subprocess.Popen:
    with log.open("w") as stderr:
        return subprocess.Popen(tune_command(argv), stdout=subprocess.DEVNULL, stderr=stderr, env=subprocess_env(),
                                start_new_session=True)


def _wait_until(condition: Callable[[], bool], process: subprocess.Popen, log: Path, what: str) -> None:
    deadline = time.monotonic() + DEADLINE_S
    while not condition():
        if process.poll() is not None:
            pytest.fail(f"the run ended (exit {process.returncode}) before {what}:\n{log.read_text()[-3000:]}")
        if time.monotonic() > deadline:
            kill_tree(process)
            pytest.fail(f"{what}: not within {DEADLINE_S} s")
        time.sleep(0.002)


def _finish(process: subprocess.Popen, log: Path) -> tuple[int, str]:
    try:
        process.wait(timeout=DEADLINE_S)
    except subprocess.TimeoutExpired:
        kill_tree(process)
        pytest.fail(f"the run did not exit within {DEADLINE_S} s:\n{log.read_text()[-3000:]}")
    return process.returncode, log.read_text()


def _steps_run(log: Path) -> int:
    """Steps this process has finished: its progress lines (``step N/12 | ...``; metrics.jsonl may still hold the
    lines of the run it resumes)."""
    return sum(1 for line in log.read_text().splitlines() if re.match(r"step \d+/\d+ \|", line))


def _signal_after_steps(argv: list[str], log: Path, steps: int, sig: signal.Signals) -> tuple[int, str]:
    """Run ``tune``, send it ``sig`` once it has run ``steps`` steps, and wait for it to exit."""
    process = _start(argv, log)
    _wait_until(lambda: _steps_run(log) >= steps, process, log, f"{steps} step(s) were run")
    process.send_signal(sig)
    return _finish(process, log)


def _assert_stopped(code: int, stderr: str, signal_name: str, output_dir: Path, nproc: int) -> int:
    """A stop on a signal: exit 143, one line at once saying what will happen, then one line naming the checkpoint
    and how to resume; returns its step."""
    assert code == EXIT_STOPPED, stderr[-3000:]
    assert "Traceback" not in stderr, stderr
    assert "exitcode" not in stderr, stderr  # a clean stop: no error line from the elastic launcher
    ours = _ours(stderr)
    assert len(ours) == 2, stderr
    assert ours[0].startswith(f"tune: {signal_name} received: finishing step "), ours
    assert "then saving a checkpoint and stopping; Ctrl-C again aborts at once" in ours[0], ours
    assert ours[1].startswith(f"tune: stopped by {signal_name} after step "), stderr
    assert ours[1].endswith("to continue, run the same command with resume_from_checkpoint=true"), ours
    step = assert_only_complete_checkpoints(output_dir, world_size=nproc)
    assert f"checkpoint {output_dir / f'step_{step:07d}'} written" in ours[1]
    assert max(logged_steps(output_dir)) == step  # the step every rank finished is the one saved
    return step


@pytest.mark.slow
@pytest.mark.distributed
def test_sigterm_through_tune_run_on_2_then_1_process_resumes_like_the_uninterrupted_run(tmp_path, reference):
    """SIGTERM to ``tune run --nproc_per_node 2``, resumed on 1 process (2 -> 1); SIGTERM again, resumed on 2
    processes (1 -> 2) to the end: the global batch is kept, so the losses are the uninterrupted run's."""
    out = tmp_path / "run"
    code, stderr = _signal_after_steps(_argv(out, nproc=2), tmp_path / "a.log", 2, signal.SIGTERM)
    _assert_stopped(code, stderr, "SIGTERM", out, nproc=2)

    resume = "resume_from_checkpoint=true"
    code, stderr = _signal_after_steps(_argv(out, resume), tmp_path / "b.log", 2, signal.SIGTERM)
    second = _assert_stopped(code, stderr, "SIGTERM", out, nproc=1)
    assert "resharded from 2 process(es) to 1" in stderr and second < STEPS

    code, stderr = _finish(_start(_argv(out, resume, nproc=2), tmp_path / "c.log"), tmp_path / "c.log")
    assert code == 0, stderr[-3000:]
    assert f"resumed from {out / f'step_{second:07d}'} at step {second}" in stderr
    _assert_same_run(out, reference, exact=False)


@pytest.mark.slow
def test_ctrl_c_once_saves_and_stops_twice_aborts_at_once_and_sigkill_anywhere_loses_nothing_saved(tmp_path, reference):
    """One process: SIGKILL while a save is being written; a first Ctrl-C (checkpoint, exit 143); Ctrl-C twice
    (ends at once, exit 130, one line saying what survived); SIGKILL at a random step; then to the end, as if
    never interrupted."""
    out, resume = tmp_path / "run", "resume_from_checkpoint=true"

    process = _start(_argv(out), tmp_path / "a.log")
    in_a_save = lambda: out.is_dir() and any(".tmp-" in p.name for p in out.iterdir())  # noqa: E731
    _wait_until(in_a_save, process, tmp_path / "a.log", "a save was under way")
    kill_tree(process)
    assert not list_checkpoints(out) or assert_only_complete_checkpoints(out, world_size=1)

    code, stderr = _signal_after_steps(_argv(out, resume), tmp_path / "b.log", 1, signal.SIGINT)
    _assert_stopped(code, stderr, "SIGINT", out, nproc=1)

    log = tmp_path / "c.log"
    process = _start(_argv(out, resume), log)
    _wait_until(lambda: _steps_run(log) >= 1, process, log, "a step was run")
    process.send_signal(signal.SIGINT)
    _wait_until(lambda: "SIGINT received: saving step" in log.read_text(), process, log, "the first Ctrl-C was seen")
    process.send_signal(signal.SIGINT)  # while the stop's checkpoint is being written
    code, stderr = _finish(process, log)
    assert code == EXIT_INTERRUPTED, stderr[-3000:]  # ended at once, nothing more ran
    assert "stopped by" not in stderr
    aborted = _ours(stderr)[-1]
    assert aborted.startswith("tune: aborted by a second Ctrl-C during step "), stderr[-3000:]
    assert aborted.endswith("to continue from there, run the same command with resume_from_checkpoint=true")

    kill_after = random.Random(0).randint(1, 3)
    process = _start(_argv(out, resume), tmp_path / "d.log")
    _wait_until(lambda: _steps_run(tmp_path / "d.log") >= kill_after, process, tmp_path / "d.log",
                f"{kill_after} step(s) were run")
    kill_tree(process)
    assert_only_complete_checkpoints(out, world_size=1)

    check_success(run_tune_in_process(_argv(out, resume)))
    _assert_same_run(out, reference, exact=True)


def _nan_in_micro_batch(monkeypatch: pytest.MonkeyPatch, step: int, micro_batch: int, accumulation: int) -> None:
    """Make the loss of one micro-batch of one step NaN (1-based), as a diverging run would."""
    calls, real = [], step_module.micro_batch_loss

    def loss(model, batch, loss_chunks=1):
        calls.append(None)
        value = real(model, batch, loss_chunks)
        return value * float("nan") if len(calls) == (step - 1) * accumulation + micro_batch else value

    monkeypatch.setattr(step_module, "micro_batch_loss", loss)


def test_a_non_finite_loss_stops_before_the_optimizer_step_and_the_last_good_checkpoint_resumes(
        tmp_path, reference, monkeypatch):
    out, split = tmp_path / "run", ("batch_size=2", "gradient_accumulation_steps=2")
    with monkeypatch.context() as patch:
        _nan_in_micro_batch(patch, step=5, micro_batch=2, accumulation=2)
        result = run_tune_in_process([*_argv(out), *split])
    assert result.returncode == EXIT_NON_FINITE, result.stderr
    ours = _ours(result.stderr)
    assert len(ours) == 1 and "Traceback" not in result.stderr, result.stderr
    for part in ("stopped at step 5: the loss of micro-batch 2 of 2 is nan (rank 0)", "no optimizer step took it in",
                 f"the newest checkpoint is still {out / 'step_0000003'}", "resume_from_checkpoint=true"):
        assert part in ours[0], (part, ours)
    assert [c.name for c in list_checkpoints(out)] == ["step_0000003"]  # the bad state was never saved
    assert [r["step"] for r in read_metrics(out)] == [1, 2, 3, 4]

    check_success(run_tune_in_process([*_argv(out, "resume_from_checkpoint=true"), *split]))
    _assert_same_run(out, reference, exact=False)  # 2 micro-batches against the reference's 1


def test_a_diverging_learning_rate_stops_on_the_gradient_norm(tmp_path):
    out = tmp_path / "run"
    result = run_tune_in_process(_argv(out, "optimizer.lr=1e30", "lr_scheduler=null", "clip_grad_norm=null",
                                       "save_every_n_steps=1"))
    assert result.returncode == EXIT_NON_FINITE, result.stderr
    (line,) = _ours(result.stderr)
    assert "stopped at step 2: the gradient norm is nan" in line and "no optimizer step took it in" in line
    assert [c.name for c in list_checkpoints(out)] == ["step_0000001"]
    weights = load_weights(final_checkpoint(out))
    assert all(torch.isfinite(value).all() for value in weights.values())


def _damage(checkpoint: Path, how: str) -> Path:
    state = checkpoint / RECIPE_STATE_DIR
    if how == "missing_distcp":
        path = next(state.glob("*.distcp"))
        path.unlink()
    else:  # a trainer_state.json cut short (it used to end resumes in a JSONDecodeError traceback)
        path = state / "trainer_state.json"
        path.write_text(path.read_text()[:40])
    return path


def test_a_damaged_checkpoint_is_skipped_for_the_previous_one_and_with_none_left_resume_says_why(
        tmp_path, reference, caplog):
    caplog.set_level(logging.INFO)
    out, resume = tmp_path / "run", "resume_from_checkpoint=true"
    shutil.copytree(reference, out)  # as if the run had been killed after its last save
    assert [c.name for c in list_checkpoints(out) if (c / RECIPE_STATE_DIR).is_dir()] == ["step_0000009",
                                                                                            "step_0000012"]
    missing = _damage(out / "step_0000012", "missing_distcp")
    result = run_tune_in_process(_argv(out, resume))
    check_success(result)
    # Set-up lines go to the log (in a `tune` process: its stderr).
    assert f"step_0000012 skipped: {missing}: missing (the manifest lists it)" in caplog.text
    assert f"resumed from {out / 'step_0000009'} at step 9" in caplog.text
    _assert_same_run(out, reference, exact=True)

    bad = [_damage(out / name, "truncated_trainer_state") for name in ("step_0000009", "step_0000012")]
    before = hash_tree(out)
    result = run_tune_in_process(_argv(out, resume))
    assert result.returncode == 2, result.stderr
    (line,) = [line for line in result.stderr.splitlines() if line.strip()]
    assert line.startswith("tune: error: resume_from_checkpoint=true: no checkpoint in") and "Traceback" not in line
    assert all(str(path) in line for path in bad), line
    assert hash_tree(out) == before


def test_a_newest_checkpoint_whose_recipe_state_was_deleted_is_refused_and_left_as_it_is(tmp_path, reference):
    """It used to be skipped: the run resumed from step 9 and replaced step 12 at its first save."""
    out = tmp_path / "run"
    shutil.copytree(reference, out)
    shutil.rmtree(out / "step_0000012" / RECIPE_STATE_DIR)
    before = hash_tree(out)
    result = run_tune_in_process(_argv(out, "resume_from_checkpoint=true"))
    assert result.returncode == 2, result.stderr
    (line,) = [line for line in result.stderr.splitlines() if line.strip()]
    for part in (f"{out / 'step_0000012'} has no recipe state", "a resume from step_0000009 would replace",
                 f"move step_0000012 out of {out}", f"checkpoint_dir={out / 'step_0000012'}"):
        assert part in line, (part, line)
    assert hash_tree(out) == before


def test_a_full_disk_during_a_save_is_one_line_and_the_earlier_checkpoints_resume(tmp_path, reference, monkeypatch):
    out = tmp_path / "run"
    real, saves = safetensors_io.save_file, []

    def fill_the_disk(tensors, filename, metadata=None):
        saves.append(filename)
        if len(saves) < 2:
            return real(tensors, filename, metadata=metadata)
        with open(filename, "wb") as f:
            f.write(b"\0" * 4096)
        raise OSError(28, "No space left on device", filename)

    with monkeypatch.context() as patch:
        patch.setattr(safetensors_io, "save_file", fill_the_disk)
        result = run_tune_in_process(_argv(out))
    assert result.returncode == 2, result.stderr
    (line,) = _ours(result.stderr)  # after the progress lines of steps 1-6
    assert "Traceback" not in result.stderr
    for part in ("tune: error: checkpoint", "step_0000006 could not be written", "No space left on device (ENOSPC)",
                 "no earlier checkpoint was touched (the newest is still step_0000003)"):
        assert part in line, (part, line)
    assert [c.name for c in list_checkpoints(out)] == ["step_0000003"]
    assert check_against_manifest(out / "step_0000003", hashes=True) is None
    assert not [p for p in out.iterdir() if p.name.startswith(".")]

    check_success(run_tune_in_process(_argv(out, "resume_from_checkpoint=true")))
    _assert_same_run(out, reference, exact=True)


def _checkpoint_bytes(checkpoint: Path) -> int:
    return sum(p.stat().st_size for p in checkpoint.rglob("*") if p.is_file())


def test_a_disk_that_cannot_hold_one_checkpoint_is_refused_before_the_first_step_and_a_tight_one_warned(
        tmp_path, reference, monkeypatch, caplog):
    caplog.set_level(logging.INFO)
    size = _checkpoint_bytes(reference / "step_0000012")  # model, recipe state, tokenizer: 25 MiB
    out = tmp_path / "a" / "run"
    for free, keep, warned in ((size // 2, None, None), (3 * size, 2, None), (int(2.5 * size), 2, "=2 keeps 2"),
                               (int(2.5 * size), None, ": null keeps the Hugging Face files")):
        caplog.clear()
        shutil.rmtree(tmp_path / "a", ignore_errors=True)
        with monkeypatch.context() as patch:
            patch.setattr(shutil, "disk_usage", lambda path: shutil._ntuple_diskusage(10 * size, 0, free))
            result = run_tune_in_process(_argv(out, f"keep_last_n_checkpoints={'null' if keep is None else keep}"))
        warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING and "free" in r.getMessage()]
        if free < size:  # refused before anything was written
            assert result.returncode == 2, result.stderr
            (line,) = _ours(result.stderr)
            assert line.startswith(f"tune: error: output_dir {out}: {free / 2**20:.1f} MiB free on its file system, "
                                   "less than one checkpoint of this run (about "), line
            estimate = float(line.split("(about ")[1].split(" MiB")[0]) * 2**20
            assert 0.97 * size < estimate < size, (estimate, size)  # the manifest and RNG files are not counted
            assert not (tmp_path / "a").exists()
            continue
        check_success(result)
        assert (warnings == []) if warned is None else (len(warnings) == 1 and warned in warnings[0]), warnings


def test_a_run_that_crashed_before_its_first_checkpoint_resumes_from_step_0(tmp_path, reference, monkeypatch, caplog):
    caplog.set_level(logging.INFO)
    out = tmp_path / "run"
    with monkeypatch.context() as patch:
        calls, real = [], step_module.micro_batch_loss

        def crash_at_step_2(model, batch, loss_chunks=1):
            calls.append(None)
            if len(calls) == 2:
                raise RuntimeError("the node went away")
            return real(model, batch, loss_chunks)

        patch.setattr(step_module, "micro_batch_loss", crash_at_step_2)
        with pytest.raises(RuntimeError):
            run_tune_in_process(_argv(out))
    assert list_checkpoints(out) == [] and [r["step"] for r in read_metrics(out)] == [1]

    fresh = run_tune_in_process(_argv(out))  # points at the resume ...
    assert fresh.returncode == 2 and "pass resume_from_checkpoint=true" in fresh.stderr, fresh.stderr
    resumed = run_tune_in_process(_argv(out, "resume_from_checkpoint=true"))  # ... which works
    check_success(resumed)
    assert "holds no checkpoint yet, so the run starts at step 0" in caplog.text
    _assert_same_run(out, reference, exact=True)


def _shape_of(embedded: Path, tmp_path: Path, **changes: int) -> Path:
    folder = tmp_path / "_".join(f"{k}{v}" for k, v in changes.items())
    folder.mkdir()
    config = json.loads((embedded / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, **changes}))
    return folder


def _dead_ends(embedded: Path, tmp_path: Path) -> dict[str, tuple[list[str], tuple[str, ...]]]:
    """name -> (overrides, parts of the one line both `tune validate` and `tune run` must give)."""
    small_vocab = _shape_of(embedded, tmp_path, vocab_size=256)
    two_formats = _two_formats(tmp_path)
    return {
        "tokenizer_beyond_the_vocabulary": (
            ["model._component_=torchtune_ac.models.llama_from_hf_config", f"+model.config={small_vocab}",
             "checkpoint_dir=null", f"tokenizer.path={embedded}"],
            ("tokenizer", "has 512 tokens (ids up to 511)", "vocabulary has 256 tokens")),
        "checkpoint_of_another_shape": (
            [f"checkpoint_dir={_shape_of(embedded, tmp_path, num_hidden_layers=4)}", f"tokenizer.path={embedded}"],
            ("config.json: describes a different model than `model`", "num_hidden_layers")),
        "optimizer_argument_the_class_rejects": (
            ["optimizer.betas=[0.9]"], ("optimizer (torch.optim.AdamW): IndexError", "betas=[0.9]")),
        # `datasets` read the parquet file alone, and trained on its 2 records without a word.
        "folder_of_data_files_in_two_formats": (
            [f"dataset.source={two_formats}"],
            ("holds data files in 2 formats (1 json, 1 parquet)", "the 1 parquet file(s) would be read and a.jsonl "
             "left out")),
        # The same folder as one item of a list of sources.
        "list_holding_a_folder_of_two_formats": (
            [f"dataset.source=[{two_formats / 'a.jsonl'},{two_formats}]"],
            (f"dataset source {two_formats}: holds data files in 2 formats", "a.jsonl left out")),
    }


def _two_formats(tmp_path: Path) -> Path:
    folder = tmp_path / "data"
    folder.mkdir()
    rows = [{"instruction": "Say hi.", "output": "hi"}] * 2
    (folder / "a.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows * 50))
    pyarrow.parquet.write_table(pyarrow.Table.from_pylist(rows), folder / "b.parquet")
    return folder


@pytest.mark.parametrize("name", ["tokenizer_beyond_the_vocabulary", "checkpoint_of_another_shape",
                                  "optimizer_argument_the_class_rejects", "folder_of_data_files_in_two_formats",
                                  "list_holding_a_folder_of_two_formats"])
def test_dead_ends_are_one_line_errors_in_validate_and_in_run(name, tmp_path, embedded_checkpoint):
    overrides, parts = _dead_ends(embedded_checkpoint, tmp_path)[name]
    out = tmp_path / "out"
    before = hash_tree(tmp_path)
    for argv in (["validate", "--config", "tiny/full", *overrides], _argv(out, *overrides)):
        result = run_tune_in_process(argv)
        assert result.returncode == 2, (argv[0], result.stderr)
        (line,) = [line for line in result.stderr.splitlines() if line.strip()]
        assert line.startswith("tune: error: ") and all(part in line for part in parts), (argv[0], parts, line)
    assert hash_tree(tmp_path) == before and not out.exists()


def test_validate_writes_nothing_and_run_creates_the_embedded_checkpoint(tmp_path, monkeypatch, capsys):
    cache = tmp_path / "cache"
    monkeypatch.setenv(CACHE_ENV_VAR, str(cache))
    from torchtune_ac.cli import main

    assert main(["validate", "--config", "tiny/full"]) == 0
    out = capsys.readouterr().out
    assert f"{cache / 'tiny-llama-v1'} does not exist" in out  # a warning, like any file missing here
    assert not cache.exists()
    check_success(run_tune_in_process(_argv(tmp_path / "run", "max_steps_per_epoch=1")))
    assert (cache / "tiny-llama-v1" / "model.safetensors").is_file()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
@pytest.mark.distributed
def test_nodes_given_different_configs_are_refused_naming_the_key(tmp_path):
    """Two single-process "nodes" on one machine, their launchers given batch_size=8 and 4."""
    port, out = _free_port(), tmp_path / "run"
    processes = []
    for node, batch in ((0, 8), (1, 4)):
        argv = tune_run_argv(out, f"batch_size={batch}")
        argv[1:1] = ["--nnodes", "2", "--node_rank", str(node), "--nproc_per_node", "1",
                     "--master_addr", "127.0.0.1", "--master_port", str(port)]
        processes.append(_start(argv, tmp_path / f"node{node}.log"))
    for node, process in enumerate(processes):
        code, stderr = _finish(process, tmp_path / f"node{node}.log")
        assert code == 2, stderr[-3000:]
        assert "Traceback" not in stderr, stderr
        assert any("batch_size is 8 on rank 0" in line and "but 4 on rank 1" in line for line in _ours(stderr)), stderr
    assert not out.exists() or not any(out.iterdir())


FAILING_RANK_RECIPE = '''"""full_finetune, with rank 1 raising at its second step, as a CUDA OOM on one GPU would."""
import importlib.util
import os
import sys

from torchtune_ac.registry import recipes_dir

from torchtune_ac.run import loop

spec = importlib.util.spec_from_file_location("full_finetune_base", recipes_dir() / "full_finetune.py")
base = importlib.util.module_from_spec(spec)
spec.loader.exec_module(base)
CONFIG_SCHEMA, preflight, run, calls, real_step = base.CONFIG_SCHEMA, base.preflight, base.run, [], loop.train_step


def failing_step(*args, **kwargs):
    calls.append(None)
    if len(calls) == 2 and os.environ.get("RANK") == "1":
        raise RuntimeError("CUDA out of memory (injected on rank 1 at step 2)")
    return real_step(*args, **kwargs)


loop.train_step = failing_step  # the step every recipe's loop takes

if __name__ == "__main__":
    from torchtune_ac.cli import recipe_main

    sys.exit(recipe_main())
'''


KILLED_RANK_RECIPE = FAILING_RANK_RECIPE.replace(
    "import os\n", "import os\nimport signal\n").replace(
    'raise RuntimeError("CUDA out of memory (injected on rank 1 at step 2)")', "os.kill(os.getpid(), signal.SIGKILL)")


@pytest.mark.slow
@pytest.mark.distributed
def test_a_rank_killed_outright_is_named_by_the_survivors_line_not_a_traceback(tmp_path):
    recipe = tmp_path / "killed.py"
    recipe.write_text(KILLED_RANK_RECIPE)
    argv = ["run", "--nproc_per_node", "2", str(recipe), "--config", "tiny/full", *SHORT_RUN,
            "max_steps_per_epoch=2", f"output_dir={tmp_path / 'run'}"]
    result = run_tune_subprocess(argv, timeout=150)
    assert result.returncode == 1 and "Traceback" not in result.stderr, result.stderr[-3000:]
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith("tune: error: rank 1 was killed by SIGKILL (the out-of-memory killer, a scheduler or "
                           "kill -9: not this run); rank 0 stopped when it lost the connection to it"), last
    assert not (tmp_path / "run" / "run.lock").exists()


@pytest.mark.distributed
def test_one_failing_rank_ends_the_run_at_once_with_its_error_printed_once(tmp_path):
    recipe = tmp_path / "failing.py"
    recipe.write_text(FAILING_RANK_RECIPE)
    argv = ["run", "--nproc_per_node", "2", str(recipe), "--config", "tiny/full", *SHORT_RUN,
            f"output_dir={tmp_path / 'run'}"]
    # A rank that tore down its process group under peers waiting in a collective could hang them (NCCL): the
    # timeout is the hang's failure; the run itself takes as long as two steps.
    result = run_tune_subprocess(argv, timeout=150)
    assert result.returncode == 1, result.stderr[-3000:]
    assert result.stderr.count("RuntimeError: CUDA out of memory (injected on rank 1 at step 2)") == 1, result.stderr
    assert "tune: error: rank 1 failed (its traceback is above)" in result.stderr
    assert "[rank0]" not in result.stderr  # rank 0's consequence is one line, not a second traceback
