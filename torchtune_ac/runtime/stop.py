"""Stopping a run cleanly on SIGTERM or Ctrl-C: every rank finishes its step, a checkpoint is written, and the run
exits with a documented status (``errors.EXIT_STOPPED``) and one line saying how to resume.

A scheduler (SLURM, Kubernetes, a spot instance's notice) sends SIGTERM; a user at a terminal presses Ctrl-C.
Either only sets a flag here: a handler runs between two bytecodes of whatever the main thread is doing, in the
middle of a collective or a write, so it must not act itself. Once per step every rank takes the largest flag of
all ranks (one all-reduce of one number), so all ranks agree on the step to stop after, even when the signal
reached only some of them; the recipe then saves and raises ``RunStopped``. The first signal is acknowledged
at once, in one line (a step can take minutes): what will happen, and what a second Ctrl-C would lose. A second
Ctrl-C ends the process at once, whatever it is doing (``before_abort`` first: the run's lock is released), with one
line saying what survived and how to go on, and exit status 130; further SIGTERMs are ignored until the process has exited. Only the process that speaks
for the run (rank 0) prints these lines.

Under ``tune run --nproc_per_node N`` the launcher forwards SIGTERM and SIGINT to every worker (``cli.py``).
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
from types import FrameType, TracebackType
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist

from torchtune_ac.errors import EXIT_INTERRUPTED
from torchtune_ac.runtime.distributed import DistributedContext

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)


class StopSignals:
    """While active (a context manager), SIGTERM and SIGINT ask the run to stop at the end of its current step.

    Outside the main thread (where Python cannot install handlers) it does nothing, and signals keep their
    usual effect.

    Args:
        announce: this process prints the lines (rank 0 of the run).
        requested: the line printed when the first signal arrives, given its name (None: nothing printed).
        aborted: the line printed when a second Ctrl-C aborts (None: nothing printed).
    """

    def __init__(self, *, announce: bool = True, requested: Optional[Callable[[str], str]] = None,
                 aborted: Optional[Callable[[], str]] = None) -> None:
        self.received: Optional[signal.Signals] = None
        self.announce = announce
        self.requested = requested
        self.aborted = aborted
        # What a second Ctrl-C does before the process ends (the run's output_dir lock is released).
        self.before_abort: Optional[Callable[[], None]] = None
        self._previous: dict[signal.Signals, Any] = {}

    def __enter__(self) -> "StopSignals":
        if threading.current_thread() is threading.main_thread():
            for sig in STOP_SIGNALS:
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, kind: Optional[type], value: Optional[BaseException], tb: Optional[TracebackType]) -> None:
        for sig, handler in self._previous.items():
            if sig == signal.SIGTERM and self.received is not None:
                # Already stopping: a later SIGTERM (the launcher ends the workers that have not exited yet once
                # one has) must not cut this process short before it has said how to resume.
                handler = signal.SIG_IGN
            signal.signal(sig, handler)
        self._previous.clear()

    def _say(self, line: Optional[str]) -> None:
        # os.write, not print: the handler may run while the main thread is inside a print.
        if self.announce and line:
            os.write(2, f"tune: {line}\n".encode())

    def _handle(self, signum: int, frame: Optional[FrameType]) -> None:
        if self.received is None:
            self.received = signal.Signals(signum)
            signal.signal(signal.SIGINT, self._abort)  # a second Ctrl-C aborts at once
            self._say(self.requested(self.received.name) if self.requested else None)

    def _abort(self, signum: int, frame: Optional[FrameType]) -> None:
        self._say(self.aborted() if self.aborted else None)
        if self.before_abort is not None:
            with contextlib.suppress(Exception):  # ending at once comes first
                self.before_abort()
        os._exit(EXIT_INTERRUPTED)

    def agreed(self, ctx: DistributedContext) -> Optional[str]:
        """The name of a stop signal some rank received (``SIGTERM`` wins over ``SIGINT``), or None. Every rank
        calls this at the same point of each step: it is one all-reduce of one number, on the host (gloo, beside
        NCCL on CUDA: ``runtime.distributed``), so the host never waits for a GPU's queue to read it."""
        value = int(self.received or 0)
        if ctx.is_distributed:
            flag = torch.tensor([value], dtype=torch.int32)  # on the CPU
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
            value = int(flag.item())
        return signal.Signals(value).name if value else None
