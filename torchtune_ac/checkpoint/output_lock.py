"""One run at a time in an ``output_dir``: a lock file held for the run's life.

Two runs writing into one ``output_dir`` (a job requeued while the first still runs, a command typed twice)
delete each other's temporary checkpoint folders and interleave their ``metrics.jsonl`` lines. So a run first
creates ``output_dir/run.lock`` with ``O_CREAT | O_EXCL`` (atomic, also on NFS v3 and later), holding the host,
the process id, the process's start time, the time the run started and a random token, and removes it when the
run ends; a second run finds the file and stops with one line naming the other run's host and pid.

- Only rank 0 of a multi-process run takes the lock; its decision is broadcast, so every rank starts or stops
  together, before any of them writes anything.
- A lock whose host is this host and whose process is gone (or whose pid now belongs to a younger process) is
  stale: it is taken over, with a warning. A lock of another host is never taken over: from here nothing can
  tell whether that run still lives, and the message says which file to delete if it does not.
- Only a lock carrying this run's token is ever deleted: a lock file replaced behind the run's back is left
  alone. A stale lock is taken over under a guard file (also ``O_EXCL``), so two runs that find the same stale
  lock cannot both take it, nor delete the fresh lock the other one just wrote.

The lock is also where ``output_dir`` is created (``create_output_dir``), once, by rank 0, before anything is
written in it.

Nothing here uses ``flock``: it does not work across the nodes of a shared file system on every system.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import secrets
import socket
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable, Iterator, Optional

import psutil
import torch.distributed as dist

from torchtune_ac.checkpoint.files import PathLike, check_writable_directory
from torchtune_ac.errors import UserError
from torchtune_ac.runtime.distributed import DistributedContext

OUTPUT_LOCK_FILE = "run.lock"
_GUARD_SUFFIX = ".takeover"
# A pid whose process started more than this many seconds away from the recorded start is another process.
_START_TIME_SLACK_S = 1.0
log = logging.getLogger(__name__)


def create_output_dir(output_dir: str | Path) -> Path:
    """Create ``output_dir`` and its parents if missing.

    Raises:
        UserError: it cannot be created (a read-only or virtual file system, a parent that is a file, ...).
    """
    path = Path(output_dir)
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise UserError(f"output_dir {path}: cannot create it ({err.strerror}: {err.filename})") from None
    return path


@dataclass(frozen=True)
class LockHolder:
    """What a lock file says about the run that holds it."""

    host: str
    pid: int
    started: str  # when the run took the lock, ISO 8601 UTC
    token: str
    process_started: Optional[float] = None  # the holder process's start time (seconds since the epoch)

    def describe(self) -> str:
        return f"host {self.host}, pid {self.pid}, started {self.started}"

    def is_stale_here(self) -> bool:
        """Whether the holder ran on this host and is gone (its pid is free, or now another, younger process)."""
        if self.host != socket.gethostname():
            return False
        try:
            process = psutil.Process(self.pid)
            created = process.create_time()
        except psutil.NoSuchProcess:
            return True
        except psutil.AccessDenied:
            return False  # it exists; whose it is cannot be told
        return self.process_started is not None and abs(created - self.process_started) > _START_TIME_SLACK_S


def read_lock(output_dir: PathLike) -> Optional[LockHolder]:
    """The holder named by ``output_dir``'s lock file, or None when there is no lock file.

    Raises:
        UserError: the lock file exists but cannot be read or parsed (a run is writing it at this instant, or
            died while doing so): naming the file and how to remove it.
    """
    path = Path(output_dir).expanduser() / OUTPUT_LOCK_FILE
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        return None
    except (OSError, UnicodeDecodeError) as err:
        raise UserError(_unreadable(path, str(err))) from None
    try:
        data = json.loads(text)
        return LockHolder(host=str(data["host"]), pid=int(data["pid"]), started=str(data["started"]),
                          token=str(data["token"]), process_started=data.get("process_started"))
    except (ValueError, KeyError, TypeError) as err:
        raise UserError(_unreadable(path, f"not a lock this version writes: {type(err).__name__}")) from None


def _unreadable(path: Path, why: str) -> str:
    return (f"output_dir {path.parent}: its lock file {path} cannot be read ({why}); another run may be starting "
            f"there: if none is, delete {path}")


def _refusal(path: Path, holder: LockHolder) -> str:
    where = ("this host" if holder.host == socket.gethostname()
             else "another host: whether it still runs cannot be told from here")
    return (f"output_dir {path.parent} is in use by another run ({holder.describe()}; {where}): wait for it to "
            f"finish or choose another output_dir; if that run is gone, delete {path}")


def _this_process(token: str) -> LockHolder:
    return LockHolder(host=socket.gethostname(), pid=os.getpid(),
                      started=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), token=token,
                      process_started=psutil.Process().create_time())


def _create(path: Path, holder: LockHolder) -> bool:
    """Create the lock file holding ``holder``; False if it already exists."""
    try:
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
    except FileExistsError:
        return False
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            json.dump({**asdict(holder), "command": " ".join(sys.argv)}, f, indent=2)
            f.write("\n")
            f.flush()
            os.fsync(f.fileno())
    except BaseException:
        path.unlink(missing_ok=True)  # ours, half written
        raise
    return True


def _take_over(path: Path, stale: LockHolder, holder: LockHolder) -> bool:
    """Replace the ``stale`` lock at ``path`` by ``holder``'s, unless another run got there first.

    Raises:
        UserError: another process holds the guard (it is taking over the same stale lock right now).
    """
    guard = path.with_name(path.name + _GUARD_SUFFIX)
    try:
        fd = os.open(guard, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
    except FileExistsError:
        raise UserError(f"output_dir {path.parent}: another process is taking over the stale lock {path} right "
                        f"now; try again in a moment (if no run is starting there, delete {guard})") from None
    try:
        os.close(fd)
        current = read_lock(path.parent)
        if current is not None and current.token == stale.token:
            path.unlink()
        return _create(path, holder)
    finally:
        guard.unlink(missing_ok=True)


def _missing_folders(output_dir: Path) -> list[Path]:
    """``output_dir`` and each of its parents that does not exist yet, deepest first."""
    missing, folder = [], output_dir
    while not folder.exists() and folder != folder.parent:
        missing.append(folder)
        folder = folder.parent
    return missing


def _acquire(output_dir: Path, token: str) -> tuple[Optional[str], Optional[str], list[Path]]:
    """Rank 0: take the lock. Returns (refusal, warning, the folders created here: ``output_dir`` and its parents
    that were missing, deepest first)."""
    try:
        check_writable_directory(output_dir, "output_dir")
    except UserError as err:
        return str(err), None, []
    created = _missing_folders(output_dir.absolute())
    try:
        create_output_dir(output_dir)
    except UserError as err:
        _remove_if_empty(created)
        return str(err), None, []
    path = output_dir / OUTPUT_LOCK_FILE
    holder = _this_process(token)
    try:
        # Another run may release, create or take over the lock between two of these calls: look again.
        for _ in range(3):
            if _create(path, holder):
                return None, None, created
            other = read_lock(output_dir)
            if other is None:
                continue  # released in between
            if not other.is_stale_here():
                return _refusal(path, other), None, created
            if _take_over(path, other, holder):
                return None, (f"output_dir {output_dir}: took over the lock of a run that is no longer running "
                              f"({other.describe()}); its checkpoints and metrics are kept"), created
    except UserError as err:
        return str(err), None, created
    except OSError as err:
        return f"output_dir {output_dir}: cannot create its lock file {path} ({err.strerror})", None, created
    return (f"output_dir {output_dir}: its lock file {path} keeps changing (other runs are starting there); try "
            "again, or choose another output_dir"), None, created


def _remove_if_empty(folders: list[Path]) -> None:
    """Remove ``folders`` (deepest first) while each is empty; stop at the first that is not."""
    for folder in folders:
        try:
            folder.rmdir()
        except OSError:
            return


def _release(output_dir: Path, token: str, created: list[Path]) -> None:
    """Rank 0: delete the lock if it is still ours, and the folders this run created (``output_dir`` and the
    parents it needed) if it left them empty."""
    path = output_dir / OUTPUT_LOCK_FILE
    try:
        current = read_lock(output_dir)
    except UserError:
        current = None
    if current is not None and current.token == token:
        path.unlink(missing_ok=True)
    elif path.exists():
        log.warning("output_dir %s: the lock file %s was replaced by another process while this run held it; "
                    "left in place", output_dir, path)
    # Only when empty: a run refused at start-up leaves neither an empty output_dir nor its new parents behind.
    _remove_if_empty(created)


@contextlib.contextmanager
def hold_output_dir(output_dir: PathLike, processes: DistributedContext) -> Iterator[Callable[[], None]]:
    """Hold ``output_dir``'s lock while the body runs (every rank of the run enters this, before any writes).

    Rank 0 creates ``output_dir`` if missing and takes the lock (taking over a stale one of this host, with a
    warning), and broadcasts the outcome, so a refusal stops every rank; on exit, by any path, rank 0 deletes
    the lock if it still holds this run's token. A process killed outright leaves its lock behind: the next run
    on the same host takes it over; on another host it is refused with the file to delete.

    Args:
        output_dir: the run's output directory.
        processes: the run's process context (``init_distributed``'s), its process group already initialised when
            distributed.

    Yields:
        What releases the lock now (on rank 0; nothing elsewhere), for a process about to end without unwinding
        (a second Ctrl-C: ``StopSignals.before_abort``); the exit releases it anyway, once.

    Raises:
        UserError: (on every rank) another run holds the lock (naming its host and pid), its lock file cannot be
            read, or ``output_dir`` or the lock file cannot be created.
    """
    output_dir = Path(output_dir).expanduser()
    token = secrets.token_hex(16)
    outcome: list[Any] = [None, None, []]  # refusal, warning, folders created here
    if processes.is_rank_zero:
        outcome = list(_acquire(output_dir, token))
    if processes.is_distributed:
        dist.broadcast_object_list(outcome, src=0)
    refusal, warning, created = outcome
    if refusal is not None:
        raise UserError(refusal)
    if warning is not None and processes.is_rank_zero:
        log.warning(warning)
    released = [not processes.is_rank_zero]

    def release() -> None:
        if not released[0]:
            released[0] = True
            _release(output_dir, token, created)

    try:
        yield release
    finally:
        release()
