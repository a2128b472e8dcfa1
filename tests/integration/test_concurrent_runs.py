"""Two runs into one output_dir, as a requeued job or a command typed twice makes them: the second is refused with
one line naming the first's host and pid, and the first finishes intact; a lock left by a killed run is taken over
on the same host, one of another host is refused."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import time

from finetune_runs import (
    assert_only_complete_checkpoints,
    check_success,
    logged_steps,
    run_tune_subprocess,
    subprocess_env,
    tune_command,
    tune_run_argv,
)

from torchtune_ac.checkpoint import OUTPUT_LOCK_FILE


def wait_for(condition, process: subprocess.Popen, what: str, timeout: float = 240) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if process.poll() is not None:
            raise AssertionError(f"the first run exited ({process.returncode}) before {what}:\n"
                                 f"{process.stderr.read()[-3000:]}")
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.05)


def test_a_second_run_into_the_same_output_dir_is_refused_and_the_first_finishes_intact(tmp_path):
    out = tmp_path / "out"
    first = subprocess.Popen(
        tune_command(tune_run_argv(out, "max_steps_per_epoch=12", "save_every_n_steps=2", "seed=1")),
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=subprocess_env(),
    )
    try:
        wait_for(lambda: len(logged_steps(out)) >= 2, first, "its second step")
        # Paused mid-run, so the second run meets it for certain, whatever the machine's speed.
        first.send_signal(signal.SIGSTOP)
        try:
            # What a requeued job runs: the same command, resuming.
            second = run_tune_subprocess(tune_run_argv(out, "max_steps_per_epoch=12", "save_every_n_steps=2",
                                                       "seed=2", "resume_from_checkpoint=true"))
        finally:
            first.send_signal(signal.SIGCONT)
        _, first_stderr = first.communicate(timeout=300)
    finally:
        first.kill()
    assert second.returncode == 2, second.stderr
    lines = second.stderr.strip().splitlines()
    assert len(lines) == 1, second.stderr
    assert lines[0].startswith(f"tune: error: output_dir {out} is in use by another run (host "
                               f"{socket.gethostname()}, pid {first.pid}, started "), lines[0]
    assert first.returncode == 0, first_stderr[-3000:]
    assert logged_steps(out) == list(range(1, 13))  # the first run's steps, once each, nothing of the second's
    assert assert_only_complete_checkpoints(out, world_size=1) == 12
    assert not (out / OUTPUT_LOCK_FILE).exists()


def test_the_lock_of_a_killed_run_is_taken_over_on_the_same_host(tmp_path):
    finished = subprocess.Popen(["true"])
    finished.wait()
    out = tmp_path / "out"
    out.mkdir()
    (out / OUTPUT_LOCK_FILE).write_text(json.dumps(
        {"host": socket.gethostname(), "pid": finished.pid, "started": "2026-01-01T00:00:00Z", "token": "old"}))
    result = run_tune_subprocess(tune_run_argv(out))
    check_success(result)
    assert (f"output_dir {out}: took over the lock of a run that is no longer running (host {socket.gethostname()}, "
            f"pid {finished.pid}, started 2026-01-01T00:00:00Z)") in result.stderr
    assert not (out / OUTPUT_LOCK_FILE).exists()


def test_the_lock_of_another_host_is_refused_and_validate_warns_of_it(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    lock = out / OUTPUT_LOCK_FILE
    lock.write_text(json.dumps({"host": "gpu-node-3", "pid": 4242, "started": "2026-01-01T00:00:00Z", "token": "x"}))
    before = lock.read_text()

    result = run_tune_subprocess(tune_run_argv(out))
    assert result.returncode == 2
    assert result.stderr == (
        f"tune: error: output_dir {out} is in use by another run (host gpu-node-3, pid 4242, started "
        "2026-01-01T00:00:00Z; another host: whether it still runs cannot be told from here): wait for it to finish "
        f"or choose another output_dir; if that run is gone, delete {lock}\n")
    assert lock.read_text() == before and sorted(os.listdir(out)) == [OUTPUT_LOCK_FILE]

    validate = run_tune_subprocess(["validate", "--config", "tiny/full", f"output_dir={out}"])
    assert validate.returncode == 0, validate.stderr
    assert (f"output_dir {out}: locked by a run (host gpu-node-3, pid 4242, started 2026-01-01T00:00:00Z): "
            "a run started now is refused") in validate.stdout
    assert any(line.split()[:2] == ["warning", "output_dir"] for line in validate.stdout.splitlines())
    assert lock.read_text() == before
