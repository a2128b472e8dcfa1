"""File-system helpers of the checkpoint package: the one atomic directory writer (and remover), JSON files, the
check that every rank sees the same directory, and failures agreed on by every rank.

Which process this is, and who the others are, is the run's process context (``runtime.distributed.
DistributedContext``), passed to every function that acts together with the other ranks (``processes``); None
means this process alone (a world of one: a test, a tool, ``tune validate``).

Every checkpoint directory (a Hugging Face export, a recipe's ``step_*`` directory) is written under a temporary
sibling name and renamed into place when complete, so a process killed mid-write never leaves a directory that
looks complete; one is deleted by renaming it to a temporary name first, for the same reason. The temporary names
belong to this module alone: ``remove_debris`` is the only code that looks for them.
"""

from __future__ import annotations

import errno
import json
import os
import secrets
import shutil
import socket
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional, TypeVar

import torch.distributed as dist
from torch.distributed.checkpoint import CheckpointException

from torchtune_ac.errors import UnavailableError, UserError
from torchtune_ac.runtime.distributed import DistributedContext

PathLike = str | os.PathLike
_TMP_MARK = ".tmp-"
_OLD_MARK = ".old-"
_SHARED_CHECK_NAME = ".shared-check"
# Below this much free space, a failed write is taken for a full file system, whatever the library reported
# (safetensors and torch.save report a full disk as their own exception types, not as OSError).
_NEARLY_FULL_BYTES = 256 << 20
T = TypeVar("T")


def together(processes: Optional[DistributedContext]) -> bool:
    """Whether the processes act together (several ranks); None, or a world of one, is this process alone."""
    return processes is not None and processes.is_distributed


def leads(processes: Optional[DistributedContext]) -> bool:
    """Whether this process writes what one process writes for all: rank 0, or the only process."""
    return processes is None or processes.is_rank_zero


def read_json(path: Path) -> Any:
    """The parsed JSON file at ``path``.

    Raises:
        UserError: the file cannot be read, is not UTF-8, or is not valid JSON (naming the file and line).
    """
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as e:
        raise UserError(f"{path}: cannot be read ({e.strerror})") from None
    except UnicodeDecodeError:
        raise UserError(f"{path}: not UTF-8 text (expected JSON)") from None
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise UserError(f"{path}: line {e.lineno}: not valid JSON ({e.msg})") from None


def write_json(path: Path, obj: Any) -> None:
    path.write_text(json.dumps(obj, indent=2, sort_keys=True) + "\n", encoding="utf-8")


def require_directory(path: PathLike, what: str) -> Path:
    """``path`` as a Path, checked to be an existing directory (``what`` names it in the message).

    Raises:
        UnavailableError: it does not exist.
        UserError: it is not a directory.
    """
    path = Path(path)
    if not path.exists():
        raise UnavailableError(f"{what} {path} does not exist")
    if not path.is_dir():
        raise UserError(f"{what} {path} is not a directory")
    return path


def check_writable_directory(path: Path, what: str) -> None:
    """Check that ``path`` is, or can be created as, a directory this process may write in (nothing is created).

    Raises:
        UserError: ``path``, or the nearest existing folder above it, is a file.
        UnavailableError: the nearest existing folder does not allow writing.
    """
    if path.exists() and not path.is_dir():
        raise UserError(f"{what} {path}: exists and is not a directory")
    existing = path
    while not existing.exists():
        existing = existing.parent
    if not existing.is_dir():
        raise UserError(f"{what} {path}: not writable ({existing} is a file, not a directory)")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise UnavailableError(f"{what} {path}: not writable ({existing} does not allow writing)")


def directory_problem(out_dir: Path, overwrite: bool) -> str | None:
    """Why a directory may not be written at ``out_dir``, or None."""
    if out_dir.exists():
        if not out_dir.is_dir():
            return f"{out_dir}: exists and is not a directory"
        if not overwrite and any(out_dir.iterdir()):
            return f"{out_dir}: directory is not empty (choose another directory or overwrite it)"
    return None


def write_directory(
    out_dir: PathLike, write: Callable[[Path], None], *, overwrite: bool = False,
    processes: Optional[DistributedContext] = None,
) -> Path:
    """Run ``write(tmp)`` on a fresh sibling directory of ``out_dir``, then rename it to ``out_dir``.

    A non-empty ``out_dir`` is refused, or with ``overwrite`` replaced, only once the new one is complete. Files
    are given the usual permissions (safetensors creates 0600 files whatever the umask) and flushed to disk
    before the rename, so a crash cannot leave a complete-looking directory of empty files.

    Args:
        out_dir: the directory to create.
        write: fills the temporary directory it is given.
        overwrite: replace an existing non-empty ``out_dir``.
        processes: every rank of the run calls this with the same arguments: rank 0 checks ``out_dir`` and
            creates the temporary directory, every rank runs ``write`` into it (each writing its own files, or
            taking part in rank 0's collectives), and rank 0 renames it once all are done. A refusal is raised on
            every rank, before anyone writes. None: this process alone.

    Returns:
        ``out_dir`` as a Path.

    Raises:
        UserError: ``out_dir`` is a file, not empty and ``overwrite`` is false, or cannot be created.
        CollectiveStepFailed: (several processes) flushing or renaming failed on rank 0, raised on every rank.
    """
    out_dir = Path(out_dir)
    collective, writer = together(processes), leads(processes)
    shared: list[Any] = [None, None]  # problem, temporary directory
    if writer:
        shared[0] = directory_problem(out_dir, overwrite)
        if shared[0] is None:
            # Same parent, so the renames below stay on one file system and are atomic.
            tmp_name = out_dir.parent / f".{out_dir.name}{_TMP_MARK}{uuid.uuid4().hex}"
            try:
                out_dir.parent.mkdir(parents=True, exist_ok=True)
                tmp_name.mkdir()
                shared[1] = str(tmp_name)
            except OSError as err:  # reported on every rank, not raised on this one alone
                shared[0] = f"{out_dir}: cannot create it ({err.strerror})"
    if collective:
        dist.broadcast_object_list(shared, src=0)
    if shared[0]:
        raise UserError(shared[0])
    tmp = Path(shared[1])

    def finish() -> None:
        if writer:
            _finish_files(tmp)
            _move_into_place(tmp, out_dir)

    try:
        write(tmp)
        if collective:
            processes.barrier()  # every rank has written its files
            run_on_every_rank(finish, where=out_dir.parent, processes=processes)  # rank 0's failure reaches all
        else:
            finish()
    except BaseException:
        if writer:
            shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out_dir


def remove_debris(parent: PathLike) -> list[Path]:
    """Delete what a process killed mid-way left in ``parent``: the temporary directory of a ``write_directory``, a
    directory ``discard_directory`` had renamed away, the token of ``check_shared_directory``.

    Returns:
        The removed paths.
    """
    parent = Path(parent)
    if not parent.is_dir():
        return []
    removed = []
    for path in parent.iterdir():
        if path.name.startswith(".") and (_TMP_MARK in path.name or _OLD_MARK in path.name):
            if path.is_dir() and not path.is_symlink():
                shutil.rmtree(path, ignore_errors=True)
            else:
                path.unlink(missing_ok=True)
            removed.append(path)
    return removed


def discard_directory(path: PathLike, debris_parent: Optional[PathLike] = None) -> None:
    """Delete the directory ``path`` so that it never looks half-deleted: rename it to a temporary name in
    ``debris_parent`` (default: its parent; same file system), then delete that. A process killed in between
    leaves debris that ``remove_debris(debris_parent)`` removes."""
    path = Path(path)
    parent = Path(debris_parent) if debris_parent is not None else path.parent
    doomed = parent / f".{path.parent.name}-{path.name}{_OLD_MARK}{uuid.uuid4().hex}"
    os.rename(path, doomed)
    shutil.rmtree(doomed)


def write_pointer(path: Path, target: str) -> None:
    """Make ``path`` point at its sibling named ``target``, replacing an earlier pointer atomically.

    The pointer is a relative symbolic link, so it survives moving the folder; on a file system without links it
    is a small text file holding ``target``. Either is made under a temporary name and renamed over ``path``, so
    a reader sees the old pointer or the new one, never none. ``read_pointer`` reads both kinds.
    """
    tmp = path.parent / f".{path.name}{_TMP_MARK}{uuid.uuid4().hex}"
    try:
        os.symlink(target, tmp)
    except OSError:
        with open(tmp, "w", encoding="utf-8") as f:
            f.write(target + "\n")
            f.flush()
            os.fsync(f.fileno())
    os.replace(tmp, path)


def read_pointer(path: Path) -> Optional[str]:
    """The name a ``write_pointer`` pointer at ``path`` holds, or None when there is no pointer there."""
    if path.is_symlink():
        return os.readlink(path)
    if path.is_file():
        return path.read_text(encoding="utf-8").strip()
    return None


def _move_into_place(tmp: Path, out_dir: Path) -> None:
    if not out_dir.exists():
        os.rename(tmp, out_dir)
        return
    old = out_dir.parent / f".{out_dir.name}{_OLD_MARK}{uuid.uuid4().hex}"
    os.rename(out_dir, old)
    try:
        os.rename(tmp, out_dir)
    except BaseException:
        os.rename(old, out_dir)
        raise
    shutil.rmtree(old)


def _finish_files(root: Path) -> None:
    """Give every file under ``root`` the permissions the umask allows, and flush files and directories."""
    umask = os.umask(0)
    os.umask(umask)
    for directory, _, files in os.walk(root):
        for name in files:
            path = os.path.join(directory, name)
            os.chmod(path, 0o666 & ~umask)
            with open(path, "rb") as f:
                os.fsync(f.fileno())
        fd = os.open(directory, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


# --------------------------------------------------------------------------------------------------------------
# Collective steps: every rank sees the same directory, and every rank hears of a failure
# --------------------------------------------------------------------------------------------------------------


def check_shared_directory(path: PathLike, what: str, processes: Optional[DistributedContext]) -> None:
    """Refuse to start unless every rank sees the files rank 0 writes in ``path`` (all ranks call this).

    Rank 0 writes a token holding a random nonce into ``path`` (created if missing), every rank reads it back, and
    rank 0 removes the token again (and ``path``, if it created it), so the check leaves nothing behind. Several
    nodes with a directory of the same name on local disks fail here, instead of writing checkpoints that look
    complete on node 0 but lack the other nodes' shards. A world of one has nothing to check.

    Raises:
        UserError: naming each rank (and its host) that does not see the token.
    """
    if not together(processes):
        return
    path = Path(path).expanduser()
    rank = processes.rank
    shared: list[Any] = [None]  # rank 0's (token file name, nonce, problem)
    created = False
    if rank == 0:
        name, nonce = f"{_SHARED_CHECK_NAME}{_TMP_MARK}{secrets.token_hex(8)}", secrets.token_hex(16)
        try:
            created = not path.exists()
            path.mkdir(parents=True, exist_ok=True)
            with open(path / name, "w", encoding="utf-8") as f:
                f.write(nonce)
                f.flush()
                os.fsync(f.fileno())
            shared[0] = (name, nonce, None)
        except OSError as err:
            shared[0] = (name, nonce, f"{what} {path}: cannot write in it ({err.strerror})")
    dist.broadcast_object_list(shared, src=0)
    name, nonce, problem = shared[0]
    token = path / name  # each rank looks in its own ``path``: the same directory only if it is shared
    if problem is None:
        try:
            seen = token.read_text(encoding="utf-8") == nonce
        except OSError:
            seen = False
    else:
        seen = True
    answers: list[Any] = [None] * processes.world_size  # one per rank
    dist.all_gather_object(answers, (seen, socket.gethostname()))
    if rank == 0:
        token.unlink(missing_ok=True)
        if created:
            try:
                path.rmdir()  # made for this check only (the run creates it when it first writes)
            except OSError:
                pass
    if problem is not None:
        raise UserError(problem)
    blind = [f"rank {r} (host {host})" for r, (ok, host) in enumerate(answers) if not ok]
    if blind:
        raise UserError(
            f"{what} {path}: {', '.join(blind)} cannot see the file rank 0 (host {answers[0][1]}) wrote there; "
            f"{what} must be one directory that every node shares (a network file system), since every rank writes "
            "its shard of each checkpoint there and reads the others' on resume"
        )


def agreed_free_bytes(path: PathLike, processes: Optional[DistributedContext]) -> int:
    """The bytes free to this user on the file system that holds ``path`` (or will: its nearest existing folder),
    as rank 0 reads them, on every rank of ``processes`` (all call this; None: this process alone)."""
    free: list[Any] = [None]
    if leads(processes):
        existing = Path(path).expanduser().absolute()
        while not existing.exists() and existing != existing.parent:
            existing = existing.parent
        free[0] = shutil.disk_usage(existing).free
    if together(processes):
        dist.broadcast_object_list(free, src=0)
    return free[0]


@dataclass(frozen=True)
class RankFailure:
    """How a step failed on one rank: one line, and whether the machine rather than our code is to blame."""

    rank: int
    message: str
    environmental: bool


class CollectiveStepFailed(Exception):
    """A collective step failed on at least one rank; raised on every rank, naming the first failure."""

    def __init__(self, failure: RankFailure) -> None:
        super().__init__(f"rank {failure.rank}: {failure.message}")
        self.failure = failure


def run_on_every_rank(step: Callable[[], T], *, where: PathLike, processes: Optional[DistributedContext] = None) -> T:
    """Run ``step`` on every rank and agree on the outcome (all ranks call this).

    Without the agreement, a rank whose write fails (a full disk) would raise alone while the others wait forever
    in the next collective. Every rank reports whether its ``step`` raised (one ``all_gather_object``), and if any
    did, every rank raises ``CollectiveStepFailed`` naming the first failing rank, chained to the local exception
    where there is one.

    Args:
        step: the work (it may call collectives itself; a failure inside one must surface on every rank, as
            torch.distributed.checkpoint's do).
        where: a path on the file system written to, to report free space on a failure.
        processes: the run's processes (None: this process alone, which raises its own failure).

    Raises:
        CollectiveStepFailed: ``step`` failed on some rank; ``failure.environmental`` says whether the file system
            (full, read-only, an I/O error) is to blame.
    """
    local: Optional[BaseException] = None
    result: Any = None
    try:
        result = step()
    except (Exception, CheckpointException) as err:  # CheckpointException is a BaseException
        local = err
    rank = processes.rank if processes is not None else 0
    report = None if local is None else _describe_failure(rank, local, Path(where))
    reports = [report]
    if together(processes):
        reports = [None] * processes.world_size  # one per rank
        dist.all_gather_object(reports, report)
    failures = [r for r in reports if r is not None]
    if failures:
        raise CollectiveStepFailed(failures[0]) from local
    return result


def _describe_failure(rank: int, err: BaseException, where: Path) -> RankFailure:
    if isinstance(err, CheckpointException) and err.failures:
        rank = min(err.failures)  # DCP raises on every rank; the failure belongs to the rank it names
    os_error = _find_os_error(err)
    cause = os_error if os_error is not None else _innermost(err)
    text = _one_line(cause)
    if os_error is not None and os_error.filename and str(os_error.filename) not in text:
        text = f"{os_error.filename}: {text}"
    try:
        free = shutil.disk_usage(where if where.exists() else where.parent).free
    except OSError:
        free = None
    nearly_full = free is not None and free < _NEARLY_FULL_BYTES
    if nearly_full:
        text += f" ({free // 2**20} MiB free on that file system)"
    environmental = os_error is not None or nearly_full or "os error" in text
    return RankFailure(rank, text, environmental)


def _find_os_error(err: Optional[BaseException], depth: int = 0) -> Optional[OSError]:
    """The first OSError in ``err``, its causes and contexts, and the per-rank failures of a DCP exception."""
    if err is None or depth > 8:
        return None
    if isinstance(err, OSError) and err.errno is not None:
        return err
    if isinstance(err, CheckpointException):
        for failure in err.failures.values():
            found = _find_os_error(failure[0] if isinstance(failure, tuple) else failure, depth + 1)
            if found is not None:
                return found
    return _find_os_error(err.__cause__ or err.__context__, depth + 1)


def _innermost(err: BaseException) -> BaseException:
    if isinstance(err, CheckpointException):
        for failure in err.failures.values():
            return _innermost(failure[0] if isinstance(failure, tuple) else failure)
    return err


def _one_line(err: BaseException) -> str:
    if isinstance(err, OSError) and err.strerror:
        return f"{err.strerror} ({errno.errorcode.get(err.errno, err.errno)})"
    lines = [line.strip() for line in str(err).splitlines() if line.strip()]
    return f"{type(err).__name__}: {lines[0] if lines else ''}"
