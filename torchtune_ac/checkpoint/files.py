"""File-system helpers of the checkpoint package: the one atomic directory writer, and JSON files.

Every checkpoint directory (a Hugging Face export, a recipe's ``step_*`` directory) is written under a temporary
sibling name and renamed into place when complete, so a process killed mid-write never leaves a directory that
looks complete. The temporary names belong to this module alone: ``remove_debris`` is the only code that looks
for them.
"""

from __future__ import annotations

import json
import os
import shutil
import uuid
from pathlib import Path
from typing import Any, Callable

import torch.distributed as dist

from torchtune_ac.errors import UserError

PathLike = str | os.PathLike
_TMP_MARK = ".tmp-"
_OLD_MARK = ".old-"


def process_group_active() -> bool:
    """Whether this process is one rank of an initialised default process group."""
    return dist.is_available() and dist.is_initialized()


def is_writer_rank() -> bool:
    """Rank 0 of the default process group, or the only process."""
    return not process_group_active() or dist.get_rank() == 0


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
        UserError: it does not exist or is not a directory.
    """
    path = Path(path)
    if not path.exists():
        raise UserError(f"{what} {path} does not exist")
    if not path.is_dir():
        raise UserError(f"{what} {path} is not a directory")
    return path


def directory_problem(out_dir: Path, overwrite: bool) -> str | None:
    """Why a directory may not be written at ``out_dir``, or None."""
    if out_dir.exists():
        if not out_dir.is_dir():
            return f"{out_dir}: exists and is not a directory"
        if not overwrite and any(out_dir.iterdir()):
            return f"{out_dir}: directory is not empty (choose another directory or overwrite it)"
    return None


def write_directory(
    out_dir: PathLike, write: Callable[[Path], None], *, overwrite: bool = False, collective: bool = False
) -> Path:
    """Run ``write(tmp)`` on a fresh sibling directory of ``out_dir``, then rename it to ``out_dir``.

    A non-empty ``out_dir`` is refused, or with ``overwrite`` replaced, only once the new one is complete. Files
    are given the usual permissions (safetensors creates 0600 files whatever the umask) and flushed to disk
    before the rename, so a crash cannot leave a complete-looking directory of empty files.

    Args:
        out_dir: the directory to create.
        write: fills the temporary directory it is given.
        overwrite: replace an existing non-empty ``out_dir``.
        collective: every rank of the default process group calls this with the same arguments: rank 0 checks
            ``out_dir`` and creates the temporary directory, every rank runs ``write`` into it (each writing its
            own files, or taking part in rank 0's collectives), and rank 0 renames it once all are done. A
            refusal is raised on every rank, before anyone writes.

    Returns:
        ``out_dir`` as a Path.

    Raises:
        UserError: ``out_dir`` is a file, or not empty and ``overwrite`` is false.
    """
    out_dir = Path(out_dir)
    collective = collective and process_group_active()
    writer = not collective or dist.get_rank() == 0
    shared: list[Any] = [None, None]  # problem, temporary directory
    if writer:
        shared[0] = directory_problem(out_dir, overwrite)
        if shared[0] is None:
            out_dir.parent.mkdir(parents=True, exist_ok=True)
            # Same parent, so the renames below stay on one file system and are atomic.
            shared[1] = str(out_dir.parent / f".{out_dir.name}{_TMP_MARK}{uuid.uuid4().hex}")
            Path(shared[1]).mkdir()
    if collective:
        dist.broadcast_object_list(shared, src=0)
    if shared[0]:
        raise UserError(shared[0])
    tmp = Path(shared[1])
    try:
        write(tmp)
        if collective:
            dist.barrier()
        if writer:
            _finish_files(tmp)
            _move_into_place(tmp, out_dir)
    except BaseException:
        if writer:
            shutil.rmtree(tmp, ignore_errors=True)
        raise
    if collective:
        dist.barrier()
    return out_dir


def remove_debris(parent: PathLike) -> list[Path]:
    """Delete what writes killed mid-way left in ``parent`` (temporary directories of ``write_directory``).

    Returns:
        The removed paths.
    """
    parent = Path(parent)
    if not parent.is_dir():
        return []
    removed = []
    for path in parent.iterdir():
        if path.name.startswith(".") and (_TMP_MARK in path.name or _OLD_MARK in path.name):
            shutil.rmtree(path, ignore_errors=True)
            removed.append(path)
    return removed


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
