"""The output_dir lock: one run at a time, stale locks of this host taken over, other hosts' locks and other
tokens never touched, and rank 0's decision reaching every rank."""

from __future__ import annotations

import json
import logging
import os
import socket
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import psutil
import pytest
import torch.distributed as dist
from gloo_testlib import run_on_gloo_ranks

from torchtune_ac.checkpoint import OUTPUT_LOCK_FILE, hold_output_dir, read_lock
from torchtune_ac.errors import UserError


@dataclass(frozen=True)
class Processes:
    is_rank_zero: bool = True
    is_distributed: bool = False


ONE = Processes()


def write_lock(output_dir: Path, *, host: str, pid: int, token: str = "theirs", process_started=None) -> Path:
    output_dir.mkdir(parents=True, exist_ok=True)
    path = output_dir / OUTPUT_LOCK_FILE
    path.write_text(json.dumps({"host": host, "pid": pid, "started": "2026-01-01T00:00:00Z", "token": token,
                                "process_started": process_started}))
    return path


def dead_pid() -> int:
    """The pid of a process that has exited (and been reaped)."""
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


def test_the_lock_is_held_while_the_body_runs_and_released_after(tmp_path):
    out = tmp_path / "out"
    with hold_output_dir(out, ONE):
        holder = read_lock(out)
        assert (holder.host, holder.pid) == (socket.gethostname(), os.getpid())
        assert holder.process_started == pytest.approx(psutil.Process().create_time())
        assert len(holder.token) == 32
    assert not (out / OUTPUT_LOCK_FILE).exists()


def test_a_second_run_is_refused_naming_the_first_runs_host_and_pid(tmp_path):
    out = tmp_path / "out"
    with hold_output_dir(out, ONE):
        first = (out / OUTPUT_LOCK_FILE).read_text()
        with pytest.raises(UserError) as refused:
            with hold_output_dir(out, ONE):
                pytest.fail("the second run got in")
        assert (out / OUTPUT_LOCK_FILE).read_text() == first  # the refused run touched nothing
    message = str(refused.value)
    assert "\n" not in message
    assert f"host {socket.gethostname()}, pid {os.getpid()}" in message
    assert f"output_dir {out} is in use by another run" in message


def test_the_lock_is_released_when_the_body_raises(tmp_path):
    with pytest.raises(RuntimeError):
        with hold_output_dir(tmp_path, ONE):
            raise RuntimeError("boom")
    assert not (tmp_path / OUTPUT_LOCK_FILE).exists()


def test_a_stale_lock_of_this_host_is_taken_over_with_a_warning(tmp_path, caplog):
    write_lock(tmp_path, host=socket.gethostname(), pid=(pid := dead_pid()))
    with caplog.at_level(logging.WARNING), hold_output_dir(tmp_path, ONE):
        assert read_lock(tmp_path).pid == os.getpid()
    assert f"took over the lock of a run that is no longer running (host {socket.gethostname()}, pid {pid}" \
        in caplog.text
    assert not (tmp_path / OUTPUT_LOCK_FILE).exists()
    # docs/reliability.md says what a kill -9 of rank 0 leaves, and quotes this line, in the run's words.
    line = caplog.records[-1].getMessage().replace(str(tmp_path), "/runs/a").replace(socket.gethostname(), "h")
    line = line.replace(f"pid {pid}", "pid 4242").replace("2026-01-01T00:00:00Z", "2026-12-06T02:40:00Z")
    page = (Path(__file__).parents[3] / "docs" / "reliability.md").read_text()
    assert "`kill -9` of rank 0" in page and f"\n{line}\n" in page


def test_a_reused_pid_is_stale_when_the_process_started_at_another_time(tmp_path):
    # This very pid is alive, but it is not the process that wrote the lock: that one started an hour earlier.
    write_lock(tmp_path, host=socket.gethostname(), pid=os.getpid(),
               process_started=psutil.Process().create_time() - 3600)
    with hold_output_dir(tmp_path, ONE):
        assert read_lock(tmp_path).token != "theirs"


def test_a_live_process_of_this_host_keeps_its_lock(tmp_path):
    path = write_lock(tmp_path, host=socket.gethostname(), pid=os.getppid())
    before = path.read_text()
    with pytest.raises(UserError, match=rf"pid {os.getppid()}, .*this host.*if that run is gone, delete {path}$"):
        with hold_output_dir(tmp_path, ONE):
            pass
    assert path.read_text() == before


def test_a_lock_of_another_host_is_never_taken_over(tmp_path):
    # Its pid is dead here, which says nothing about the other host.
    path = write_lock(tmp_path, host="node-17.cluster", pid=dead_pid())
    before = path.read_text()
    with pytest.raises(UserError) as refused:
        with hold_output_dir(tmp_path, ONE):
            pass
    assert "host node-17.cluster" in str(refused.value)
    assert "another host: whether it still runs cannot be told from here" in str(refused.value)
    assert f"delete {path}" in str(refused.value)
    assert path.read_text() == before


def test_a_lock_file_with_another_token_is_not_deleted(tmp_path):
    """The lock was replaced while the run held it (by hand, say): the run leaves the other one's file alone."""
    with hold_output_dir(tmp_path, ONE):
        replaced = write_lock(tmp_path, host=socket.gethostname(), pid=os.getpid(), token="someone-else")
    assert json.loads(replaced.read_text())["token"] == "someone-else"


def test_a_takeover_in_progress_is_not_raced(tmp_path):
    write_lock(tmp_path, host=socket.gethostname(), pid=dead_pid())
    guard = tmp_path / f"{OUTPUT_LOCK_FILE}.takeover"
    guard.write_text("")
    with pytest.raises(UserError, match="another process is taking over the stale lock"):
        with hold_output_dir(tmp_path, ONE):
            pass
    assert read_lock(tmp_path).token == "theirs" and guard.exists()


def test_an_unreadable_lock_is_refused_not_replaced(tmp_path):
    (tmp_path / OUTPUT_LOCK_FILE).write_text("")  # a run died between creating and writing it
    with pytest.raises(UserError, match=rf"cannot be read .*delete {tmp_path / OUTPUT_LOCK_FILE}$"):
        with hold_output_dir(tmp_path, ONE):
            pass
    assert (tmp_path / OUTPUT_LOCK_FILE).read_text() == ""


def test_an_output_dir_created_for_the_lock_is_removed_if_the_run_left_it_empty(tmp_path):
    with hold_output_dir(tmp_path / "a" / "b", ONE):
        pass
    assert not (tmp_path / "a").exists()  # the parent created for it too
    (tmp_path / "d").mkdir()
    with hold_output_dir(tmp_path / "d" / "e" / "f", ONE):
        (tmp_path / "d" / "e" / "g").mkdir()  # something else landed in a created parent: kept, with that parent
    assert sorted(p.relative_to(tmp_path).as_posix() for p in tmp_path.rglob("*")) == ["d", "d/e", "d/e/g"]
    with hold_output_dir(tmp_path / "c", ONE):
        (tmp_path / "c" / "metrics.jsonl").write_text("")
    assert (tmp_path / "c" / "metrics.jsonl").exists()


def _ranks_meet_a_foreign_lock(rank: int, out: str, result_dir: str) -> None:
    processes = Processes(is_rank_zero=rank == 0, is_distributed=True)
    try:
        with hold_output_dir(out, processes):
            outcome = "entered"
    except UserError as err:
        outcome = str(err)
    Path(result_dir, f"rank{rank}").write_text(outcome)
    dist.barrier()


def test_every_rank_hears_rank_zeros_refusal(tmp_path):
    out = tmp_path / "out"
    write_lock(out, host="node-17.cluster", pid=1234)
    run_on_gloo_ranks(_ranks_meet_a_foreign_lock, str(out), str(tmp_path), store_dir=tmp_path)
    outcomes = [(tmp_path / f"rank{r}").read_text() for r in range(2)]
    assert outcomes[0] == outcomes[1]
    assert "is in use by another run (host node-17.cluster, pid 1234" in outcomes[0]
