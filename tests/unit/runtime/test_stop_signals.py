"""SIGTERM and a first Ctrl-C only record a request to stop; a second Ctrl-C gets SIGINT's default action back;
the handlers go back to what they were when the run ends without a signal."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from typing import Iterator

import pytest
import torch

from torchtune_ac.runtime.distributed import DistributedContext
from torchtune_ac.runtime.stop import StopSignals

CTX = DistributedContext(0, 1, 0, torch.device("cpu"))


@pytest.fixture
def restored_handlers() -> Iterator[None]:
    """A received signal leaves SIGTERM ignored for the rest of the process; give pytest its handlers back."""
    saved = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT)}
    yield
    for sig, handler in saved.items():
        signal.signal(sig, handler)


def test_without_a_signal_nothing_is_requested_and_handlers_come_back(restored_handlers):
    before = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT)}
    with StopSignals() as stop:
        assert signal.getsignal(signal.SIGTERM) == stop._handle
        assert stop.agreed(CTX) is None
    assert {sig: signal.getsignal(sig) for sig in before} == before


@pytest.mark.parametrize("first", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_is_only_recorded_then_a_ctrl_c_aborts_and_sigterm_is_ignored(restored_handlers, first):
    with StopSignals() as stop:
        os.kill(os.getpid(), first)  # delivered to this (main) thread before kill returns to Python code
        assert stop.received == first
        assert stop.agreed(CTX) == first.name
        assert signal.getsignal(signal.SIGINT) == stop._abort  # a second Ctrl-C ends the process at once
        os.kill(os.getpid(), signal.SIGTERM)  # a repeated SIGTERM changes nothing
        assert stop.received == first
    assert signal.getsignal(signal.SIGTERM) == signal.SIG_IGN  # already stopping: later SIGTERMs cannot cut it short


def test_the_first_signal_is_acknowledged_at_once_and_a_second_ctrl_c_says_what_survived(tmp_path):
    # In a child process: the second Ctrl-C ends it with os._exit.
    script = tmp_path / "child.py"
    script.write_text(
        "import os, signal, time\n"
        "from torchtune_ac.runtime.stop import StopSignals\n"
        "with StopSignals(requested=lambda name: f'{name} asked', aborted=lambda: 'gone') as stop:\n"
        "    os.kill(os.getpid(), signal.SIGINT)\n"
        "    print('still running', flush=True)\n"
        "    os.kill(os.getpid(), signal.SIGINT)\n"
        "    time.sleep(5)\n"
        "print('not reached', flush=True)\n"
    )
    result = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=60)
    assert result.returncode == 130
    assert result.stdout == "still running\n"
    assert result.stderr.splitlines() == ["tune: SIGINT asked", "tune: gone"]


def test_a_second_ctrl_c_releases_the_output_dir_lock_before_it_ends_the_process(tmp_path):
    script = tmp_path / "child.py"
    script.write_text(
        "import os, signal, sys, time, torch\n"
        "from torchtune_ac.checkpoint import hold_output_dir\n"
        "from torchtune_ac.runtime.distributed import DistributedContext\n"
        "from torchtune_ac.runtime.stop import StopSignals\n"
        "ctx = DistributedContext(0, 1, 0, torch.device('cpu'))\n"
        "with StopSignals() as stop, hold_output_dir(sys.argv[1], ctx) as release:\n"
        "    stop.before_abort = release  # as open_run sets it\n"
        "    print(sorted(os.listdir(sys.argv[1])), flush=True)\n"
        "    os.kill(os.getpid(), signal.SIGTERM)\n"
        "    os.kill(os.getpid(), signal.SIGINT)\n"
        "    time.sleep(5)\n"
    )
    out = tmp_path / "out"
    result = subprocess.run([sys.executable, str(script), str(out)], capture_output=True, text=True, timeout=60)
    assert (result.returncode, result.stdout) == (130, "['run.lock']\n"), result.stderr
    assert not out.exists()  # the lock released, and the output_dir it created, left empty, removed


def test_a_process_that_does_not_speak_for_the_run_prints_nothing(tmp_path):
    script = tmp_path / "child.py"
    script.write_text(
        "import os, signal\n"
        "from torchtune_ac.runtime.stop import StopSignals\n"
        "with StopSignals(announce=False, requested=lambda name: 'asked', aborted=lambda: 'gone'):\n"
        "    os.kill(os.getpid(), signal.SIGTERM)\n"
        "    os.kill(os.getpid(), signal.SIGINT)\n"
    )
    result = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=60)
    assert (result.returncode, result.stderr) == (130, "")
