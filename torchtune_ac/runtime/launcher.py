"""The launcher of a multi-process run: ``tune run --nproc_per_node N`` starts the recipe in N processes with
PyTorch's own elastic launcher (``torch.distributed.run``), forwards stop signals to them, turns their exit
statuses into the run's, and lets each worker leave with its exact status.

What a user reads of a failed multi-process run is one line per distinct problem: a worker's one-line error
(exit 2) is handed to the launcher (``report_worker_error``) instead of being printed by every process, and the
launcher prints each distinct one once; the elastic launcher's own log lines about ending the other workers
are not shown. Each worker gets its share of the cores this process may use (``cpu_threads.worker_environment``),
unless the user set ``OMP_NUM_THREADS``: N processes with the default threads each would oversubscribe the cores.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import signal
import sys
import tempfile
from pathlib import Path
from typing import Callable, Iterator, Mapping, NoReturn, Optional, Sequence

from torchtune_ac.errors import (
    EXIT_INTERRUPTED,
    EXIT_NON_FINITE,
    EXIT_STOPPED,
    EXIT_USER_ERROR,
    RunStopped,
)
from torchtune_ac.runtime.cpu_threads import worker_environment


def int_at_least(minimum: int, maximum: Optional[int] = None) -> Callable[[str], int]:
    """An argparse ``type`` for an integer in [minimum, maximum] (a bad value is a usage error, exit 2)."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
        if value < minimum or (maximum is not None and value > maximum):
            bound = f"between {minimum} and {maximum}" if maximum is not None else f">= {minimum}"
            raise argparse.ArgumentTypeError(f"must be {bound}, got {value}")
        return value

    return parse


def parse_nnodes(text: str) -> str:
    """``N`` or ``MIN:MAX`` (an elastic range), as torch.distributed.run takes it."""
    bounds = text.split(":")
    if len(bounds) > 2 or not all(b.isdigit() and int(b) >= 1 for b in bounds) or int(bounds[0]) > int(bounds[-1]):
        raise argparse.ArgumentTypeError(f"expected N or MIN:MAX with 1 <= MIN <= MAX, got {text!r}")
    return text


# Launcher flags forwarded to torch.distributed.run (the elastic launcher), with how argparse reads them.
LAUNCHER_FLAGS = {
    "nproc_per_node": (("--nproc_per_node", "--nproc-per-node"), int_at_least(1)),
    "nnodes": (("--nnodes",), parse_nnodes),
    "node_rank": (("--node_rank", "--node-rank"), int_at_least(0)),
    "rdzv_endpoint": (("--rdzv_endpoint", "--rdzv-endpoint"), str),
    "rdzv_backend": (("--rdzv_backend", "--rdzv-backend"), str),
    "master_addr": (("--master_addr", "--master-addr"), str),
    "master_port": (("--master_port", "--master-port"), int_at_least(1, 65535)),
}


def launched_world_size() -> int:
    """Processes the elastic launcher started this run with (1 outside it), before any process group exists: what a
    worker needs to know to hand its errors to the launcher. Everything after start-up asks the run's process
    context (``distributed.init_distributed``)."""
    return int(os.environ.get("WORLD_SIZE", "1"))


def launched_rank() -> str:
    """This worker's rank as the elastic launcher gave it (``?`` outside it), for a message."""
    return os.environ.get("RANK", "?")


def leave_worker(status: int) -> NoReturn:
    """End a worker of a multi-process run with ``status``, skipping the interpreter's teardown.

    By the time a recipe returns, its work is done and closed: the checkpoint written, ``metrics.jsonl`` and the
    trackers closed, the process group destroyed after a barrier. FSDP2's device mesh still holds the gloo
    process group, though, and it is freed during interpreter finalisation, where a C++ destructor race in
    gloo's threads ("terminate called without an active exception") has killed a finished worker with SIGABRT
    about once in a hundred runs: the launcher then reports a successful run as failed (or hides the real
    status, 143 or 3, behind -6). Leaving with ``os._exit`` after flushing is what makes the status exact.
    """
    import logging

    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(status)


def launch_elastic(launcher: dict, recipe_path: Path, recipe_argv: Sequence[str]) -> int:
    """Run ``recipe_path`` as a script in the processes ``launcher`` asks for (torch.distributed.run's flags, as
    ``LAUNCHER_FLAGS`` reads them), with ``recipe_argv`` after it, and return the run's exit status.

    SIGTERM and SIGINT reach every worker once (``forward_stop_signals``); the status is that of the workers
    that exited on their own (``status_of_failed_workers``).
    """
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import get_args_parser, run

    torchrun_argv = []
    for name, value in launcher.items():
        torchrun_argv += [f"--{name}", str(value)]
    # Single node and no rendezvous flag: let the launcher pick a free port. (--standalone would override a
    # --master_port or --rdzv_backend the user gave.)
    rendezvous_flags = {"rdzv_endpoint", "rdzv_backend", "master_addr", "master_port"}
    if not rendezvous_flags & launcher.keys() and launcher.get("nnodes", "1") == "1":
        torchrun_argv.append("--standalone")
    torchrun_argv += [str(recipe_path), *recipe_argv]
    # Workers run the recipe file as a script: make sure they import this same torchtune_ac.
    package_root = str(Path(__file__).resolve().parents[2])
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [package_root, os.environ.get("PYTHONPATH")]))
    torchrun_args = get_args_parser().parse_args(torchrun_argv)
    if hasattr(torchrun_args, "signals_to_handle"):
        # SIGTERM and SIGINT are ours to forward (see forward_stop_signals); the launcher keeps the others.
        torchrun_args.signals_to_handle = ",".join(
            name for name in torchrun_args.signals_to_handle.split(",") if name.strip() not in ("SIGTERM", "SIGINT")
        )
    threads = worker_environment(os.environ, int(launcher.get("nproc_per_node", 1)))
    with tempfile.TemporaryDirectory(prefix="tune-run-") as reports, _quiet_elastic_logs(), _environ(
        {REPORTS_ENV_VAR: reports, **threads}
    ):
        try:
            with forward_stop_signals():
                run(torchrun_args)
        except ChildFailedError as err:
            codes = {rank: failure.exitcode for rank, failure in err.failures.items()}
            report_first_failure(Path(reports))
            return status_of_failed_workers(codes, read_worker_errors(Path(reports)), read_lost_workers(Path(reports)))
    return 0


REPORTS_ENV_VAR = "TORCHTUNE_AC_WORKER_REPORTS"


def report_worker_error(message: str) -> bool:
    """In a worker started by ``launch_elastic``: hand a one-line error to the launcher, which prints each distinct
    one once. Returns False (the caller prints it) outside such a worker."""
    folder = os.environ.get(REPORTS_ENV_VAR)
    if not folder or not Path(folder).is_dir():
        return False
    (Path(folder) / f"rank_{os.environ.get('RANK', '0')}.txt").write_text(message, encoding="utf-8")
    return True


def report_worker_failure(text: str) -> bool:
    """In a worker started by ``launch_elastic``: hand an unexpected failure's traceback to the launcher, which
    prints the first rank's in full and one line for each rank that failed after it (usually because the first
    one left its collectives). Returns False (the caller prints it) outside such a worker."""
    folder = os.environ.get(REPORTS_ENV_VAR)
    if not folder or not Path(folder).is_dir():
        return False
    (Path(folder) / f"rank_{os.environ.get('RANK', '0')}.failure").write_text(text, encoding="utf-8")
    return True


# What a collective raises on a rank whose peer process died (gloo's TCP pair, NCCL's watchdog).
LOST_PEER_MARKERS = ("Connection closed by peer", "Connection reset by peer", "Broken pipe",
                     "remote process exited")


def lost_peer(err: BaseException) -> Optional[str]:
    """What ``err`` says in one line when it is a collective failing because another process of the run died, or
    None (any other failure)."""
    text = str(err)
    if not isinstance(err, RuntimeError) or not any(marker in text for marker in LOST_PEER_MARKERS):
        return None
    first = text.strip().splitlines()[0] if text.strip() else ""
    return first.split("] ", 1)[-1].split(". This is typically", 1)[0]  # gloo's source location and advice cut


def report_worker_lost(line: str) -> bool:
    """In a worker started by ``launch_elastic``: tell the launcher that this rank stopped because another process
    of the run died (``lost_peer``'s line); the launcher names the process that died instead of this one's
    traceback. Returns False (the caller prints it) outside such a worker."""
    folder = os.environ.get(REPORTS_ENV_VAR)
    if not folder or not Path(folder).is_dir():
        return False
    (Path(folder) / f"rank_{os.environ.get('RANK', '0')}.lost").write_text(line, encoding="utf-8")
    return True


def read_lost_workers(folder: Path) -> dict[int, str]:
    """rank -> the line of a worker that stopped because another process died (``report_worker_lost``)."""
    return {int(path.stem.removeprefix("rank_")): path.read_text(encoding="utf-8")
            for path in folder.glob("rank_*.lost")}


def report_first_failure(folder: Path) -> None:
    """Print the workers' failures (``report_worker_failure``): the first in full, the later ones in a line each."""
    failures = sorted(folder.glob("rank_*.failure"), key=lambda path: path.stat().st_mtime_ns)
    for index, path in enumerate(failures):
        rank = path.stem.removeprefix("rank_")
        text = path.read_text(encoding="utf-8").rstrip()
        if index == 0:
            print(f"{text}\ntune: error: rank {rank} failed (its traceback is above)", file=sys.stderr, flush=True)
        else:
            last = text.splitlines()[-1] if text else "no message"
            print(f"tune: error: rank {rank} failed after it: {last}", file=sys.stderr, flush=True)


def read_worker_errors(folder: Path) -> dict[int, str]:
    """rank -> the error that worker handed over (``report_worker_error``)."""
    return {int(path.stem.removeprefix("rank_")): path.read_text(encoding="utf-8")
            for path in folder.glob("rank_*.txt")}


@contextlib.contextmanager
def _environ(values: Mapping[str, str]) -> Iterator[None]:
    previous = {name: os.environ.get(name) for name in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for name, value in previous.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


@contextlib.contextmanager
def _quiet_elastic_logs() -> Iterator[None]:
    """The elastic launcher logs every worker it ends ("Sending process ... closing signal SIGTERM") and every
    non-zero exit as an error, a clean stop (143) included; the run's own lines say what happened instead."""
    logger = logging.getLogger("torch.distributed.elastic")
    level = logger.level
    logger.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        logger.setLevel(level)


STATUSES_OF_WORKERS = (EXIT_USER_ERROR, EXIT_NON_FINITE, EXIT_STOPPED)


def status_of_failed_workers(exit_codes: dict[int, int], errors: Optional[Mapping[int, str]] = None,
                             lost: Optional[Mapping[int, str]] = None) -> int:
    """The launcher's exit status from its workers' (a negative code: killed by that signal), after printing each
    distinct error the workers handed over (``errors``: rank -> one line) once.

    A worker killed by a signal the launcher does not send (SIGKILL from the out-of-memory killer or ``kill -9``,
    SIGSEGV, ...) is named in one line, with the ranks that stopped because they lost it (``lost``: rank -> what
    their collective said); the status is then 1. Otherwise a rank that lost another (which failed in its own way,
    said above) gets a line of its own.
    """
    lost = dict(lost or {})
    killed = {rank: -code for rank, code in exit_codes.items()
              if code < 0 and -code not in (signal.SIGTERM, signal.SIGINT)}
    if killed:
        print(f"tune: error: {_died(killed, lost)}; the checkpoints written before are complete: to continue, "
              "run the same command with resume_from_checkpoint=true", file=sys.stderr, flush=True)
        return 1
    for rank, line in sorted(lost.items()):
        print(f"tune: error: rank {rank} stopped: it lost the connection to another process in a collective "
              f"({line})", file=sys.stderr, flush=True)
    # When one worker fails, the launcher terminates the others (negative codes: killed by a signal); the status
    # that matters is that of the workers that exited on their own.
    exited = {rank: code for rank, code in exit_codes.items() if code > 0}
    codes = sorted(set(exited.values()))
    if codes == [EXIT_STOPPED]:
        return EXIT_STOPPED  # rank 0 said where the checkpoint is and how to resume
    if codes == [EXIT_INTERRUPTED]:
        return EXIT_INTERRUPTED  # a second Ctrl-C: rank 0 said what survived
    if not codes and set(exit_codes.values()) == {-signal.SIGINT}:
        print("tune: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    errors = dict(errors or {})
    by_message: dict[str, list[int]] = {}
    for rank, message in sorted(errors.items()):
        by_message.setdefault(message, []).append(rank)
    for message, ranks in by_message.items():
        where = "" if len(by_message) == 1 else f"rank {', '.join(map(str, ranks))}: "
        print(f"tune: error: {where}{message}", file=sys.stderr, flush=True)
    if codes == [EXIT_USER_ERROR] and exited.keys() <= errors.keys():
        return EXIT_USER_ERROR  # every failed worker said why, in the lines above
    print(f"tune: error: process(es) {sorted(exited) or sorted(exit_codes)} failed with exit status "
          f"{codes or sorted(set(exit_codes.values()))}; see their messages above", file=sys.stderr)
    return codes[0] if len(codes) == 1 and codes[0] in STATUSES_OF_WORKERS else 1


def _died(killed: Mapping[int, int], lost: Mapping[int, str]) -> str:
    """What happened to a run one of whose processes died, in a clause."""
    def ranks(found: Mapping[int, object]) -> str:
        return f"rank{'s' if len(found) > 1 else ''} {', '.join(map(str, sorted(found)))}"

    parts = []
    for rank, signum in sorted(killed.items()):
        name = signal.Signals(signum).name if signum in signal.Signals._value2member_map_ else f"signal {signum}"
        how = (" (the out-of-memory killer, a scheduler or kill -9: not this run)" if signum == signal.SIGKILL
               else "")
        parts.append(f"rank {rank} was killed by {name}{how}")
    if lost:
        example = next(iter(sorted(lost.items())))[1]
        parts.append(f"{ranks(lost)} stopped when {'they' if len(lost) > 1 else 'it'} lost the connection to "
                     f"{'it' if len(killed) == 1 else 'them'} in a collective ({example})")
    return "; ".join(parts)


@contextlib.contextmanager
def forward_stop_signals() -> Iterator[None]:
    """While the workers run, the launcher passes SIGTERM and SIGINT on to each of them, so they stop after their
    current step with a checkpoint (a second SIGINT: at once), and keeps waiting for them to exit with their own
    status. The workers run in sessions of their own, so a Ctrl-C at the terminal reaches only the launcher, and
    each signal reaches each worker once. Before any worker exists, there is nothing to save: the signal ends the
    launch."""
    import psutil

    def forward(signum: int, frame: object) -> None:
        workers = psutil.Process().children()
        if not workers:
            raise RunStopped(f"stopped by {signal.Signals(signum).name} before the processes started: nothing to save; "
                             "to continue, run the same command with resume_from_checkpoint=true",
                             exit_status=EXIT_STOPPED)
        for worker in workers:
            try:
                os.kill(worker.pid, signum)
            except ProcessLookupError:
                pass

    previous = {sig: signal.signal(sig, forward) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
