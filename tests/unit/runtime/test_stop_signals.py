"""SIGTERM and a first Ctrl-C only record a request to stop; a second Ctrl-C gets SIGINT's default action back;
the handlers go back to what they were when the run ends without a signal."""

from __future__ import annotations

import os
import signal
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
        assert signal.getsignal(signal.SIGINT) == signal.SIG_DFL  # a second Ctrl-C ends the process at once
        os.kill(os.getpid(), signal.SIGTERM)  # a repeated SIGTERM changes nothing
        assert stop.received == first
    assert signal.getsignal(signal.SIGTERM) == signal.SIG_IGN  # already stopping: later SIGTERMs cannot cut it short
