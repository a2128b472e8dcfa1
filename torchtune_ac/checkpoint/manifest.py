"""The manifest that ends every checkpoint of a run: each file's size and SHA-256, written last, checked on resume.

A checkpoint directory is renamed into place only once complete (``files.write_directory``), so our own writes
never leave a partial checkpoint. The manifest catches what happens to the files afterwards, or around us: a
copy cut short, a file deleted by hand, a disk or network file system that lost a write. Resume checks it and
skips a checkpoint that fails for the previous complete one.

``manifest.json``::

    {"format": 1, "algorithm": "sha256",
     "files": {"config.json": {"size": 712, "sha256": "9f2c..."}, "recipe_state/__0_0.distcp": {...}, ...}}

Why SHA-256: it is in the standard library, any machine can check a file with ``sha256sum``, and x86 (SHA-NI)
and ARMv8 CPUs compute it in hardware, where it is faster than BLAKE2 (measured here: 0.8 GiB/s per core against
0.54 for BLAKE2b; CRC32 is 2.1 GiB/s but is no file checksum a user can check with a standard tool).
The cost is one read of the checkpoint, split between ranks: the files are dealt out by size, each rank hashes
its share and rank 0 gathers the digests, so N ranks each read about 1/N of it (a 100 GB checkpoint on 8 ranks:
about 15 s). Reading right after writing is served from the page cache.

Every function given several ``processes`` (the run's context) is called by all its ranks.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import torch.distributed as dist

from torchtune_ac.checkpoint.files import leads, together
from torchtune_ac.runtime.distributed import DistributedContext

MANIFEST_FILE = "manifest.json"
ALGORITHM = "sha256"
_FORMAT = 1
_CHUNK = 4 << 20


@dataclass(frozen=True)
class FileRecord:
    """What the manifest says of one file."""

    size: int
    sha256: str


def hash_file(path: Path) -> str:
    """The SHA-256 of the file at ``path``, as lowercase hex (read in 4 MiB chunks)."""
    digest = hashlib.sha256()
    buffer = bytearray(_CHUNK)
    view = memoryview(buffer)
    with open(path, "rb", buffering=0) as f:
        while n := f.readinto(buffer):
            digest.update(view[:n])
    return digest.hexdigest()


def _list_files(root: Path) -> dict[str, int]:
    """``relative posix path -> size`` of every file under ``root`` but the manifest, sorted."""
    found = {}
    for directory, _, names in os.walk(root):
        for name in names:
            path = Path(directory) / name
            relative = path.relative_to(root).as_posix()
            if relative != MANIFEST_FILE:
                found[relative] = path.stat().st_size
    return dict(sorted(found.items()))


def _share(sizes: dict[str, int], rank: int, world_size: int) -> list[str]:
    """The files ``rank`` hashes: largest first, each to the rank with the fewest bytes so far (ties: lowest rank).
    Every rank computes the same deal from the same sizes."""
    loads = [0] * world_size
    mine = []
    for name, size in sorted(sizes.items(), key=lambda item: (-item[1], item[0])):
        owner = min(range(world_size), key=lambda r: (loads[r], r))
        loads[owner] += size
        if owner == rank:
            mine.append(name)
    return mine


def hash_files(root: Path, sizes: dict[str, int], processes: Optional[DistributedContext]) -> dict[str, str]:
    """``relative path -> SHA-256`` of ``sizes``' files, each rank hashing its share; every rank gets them all.

    A file a rank cannot read gets ``"!" + the reason`` instead of a digest, so every rank still reaches the
    gather (a rank that raised there would leave the others waiting).
    """
    collective = together(processes)
    rank, world_size = (processes.rank, processes.world_size) if collective else (0, 1)
    digests = {}
    for name in _share(sizes, rank, world_size):
        try:
            digests[name] = hash_file(root / name)
        except OSError as err:
            digests[name] = f"!{root / name}: cannot be read ({err.strerror})"
    if collective:
        gathered: list[Any] = [None] * world_size
        dist.all_gather_object(gathered, digests)
        digests = {name: digest for part in gathered for name, digest in part.items()}
    return digests


def _agreed(value: Any, processes: Optional[DistributedContext]) -> Any:
    """Rank 0's ``value`` on every rank (``value`` itself for one process)."""
    if not together(processes):
        return value
    box = [value if processes.is_rank_zero else None]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def write_manifest(root: Path, *, processes: Optional[DistributedContext] = None) -> None:
    """Write ``root/manifest.json`` for every file under ``root`` (call it once every file is written).

    Rank 0 lists the files and tells the others, each rank hashes its share, rank 0 writes the manifest.

    Raises:
        OSError: a file could not be read back (on every rank), or the manifest could not be written (rank 0).
    """
    lead = leads(processes)
    listing: Any = None
    if lead:
        try:
            listing = _list_files(root)
        except OSError as err:  # told to every rank, which all raise below
            listing = f"{root}: cannot be listed ({err.strerror})"
    sizes = _agreed(listing, processes)
    if isinstance(sizes, str):
        raise OSError(sizes)
    digests = hash_files(root, sizes, processes)
    unreadable = [digest[1:] for digest in digests.values() if digest.startswith("!")]
    if unreadable:
        raise OSError(f"cannot hash the checkpoint's files: {unreadable[0]}")
    if lead:
        files = {name: {"size": size, ALGORITHM: digests[name]} for name, size in sizes.items()}
        _write_json_atomically(root / MANIFEST_FILE, {"format": _FORMAT, "algorithm": ALGORITHM, "files": files})


def _write_json_atomically(path: Path, obj: Any) -> None:
    tmp = path.parent / f".{path.name}.tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(json.dumps(obj, indent=1, sort_keys=True) + "\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def read_manifest(root: Path) -> tuple[Optional[dict[str, FileRecord]], Optional[str]]:
    """The files ``root/manifest.json`` lists, or why it cannot be read (one line naming the file)."""
    path = root / MANIFEST_FILE
    if not path.is_file():
        return None, f"{path}: missing (the manifest is written last: the save did not complete)"
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
        if data.get("format") != _FORMAT or data.get("algorithm") != ALGORITHM:
            return None, f"{path}: format {data.get('format')!r} / {data.get('algorithm')!r} is not one this version reads"
        records = {name: FileRecord(int(entry["size"]), str(entry[ALGORITHM])) for name, entry in data["files"].items()}
    except (OSError, UnicodeDecodeError, ValueError, KeyError, TypeError, AttributeError) as err:
        return None, f"{path}: unreadable ({type(err).__name__}: {err})"
    return records, None


def write_manifest_without(root: Path, prefix: str) -> None:
    """Rewrite ``root``'s manifest without the files under ``prefix``, atomically (before deleting those files, so
    the manifest never lists a file that is gone)."""
    records, _ = read_manifest(root)
    if records is None:
        return
    files = {name: {"size": r.size, ALGORITHM: r.sha256} for name, r in records.items() if not name.startswith(prefix)}
    _write_json_atomically(root / MANIFEST_FILE, {"format": _FORMAT, "algorithm": ALGORITHM, "files": files})


def _check_sizes(root: Path, require: str) -> tuple[Optional[str], dict[str, int], dict[str, FileRecord]]:
    records, problem = read_manifest(root)
    if records is None:
        return problem, {}, {}
    if require and require not in records:
        return f"{root / MANIFEST_FILE}: does not list {require}", {}, {}
    sizes = {}
    for name, record in records.items():
        path = root / name
        try:
            size = path.stat().st_size
        except FileNotFoundError:
            return f"{path}: missing (the manifest lists it)", {}, {}
        except OSError as err:
            return f"{path}: cannot be read ({err.strerror})", {}, {}
        if size != record.size:
            return f"{path}: {size} bytes, the manifest says {record.size} (truncated or changed)", {}, {}
        sizes[name] = size
    return None, sizes, records


def check_against_manifest(root: Path, *, hashes: bool, processes: Optional[DistributedContext] = None,
                           require: str = "") -> Optional[str]:
    """Why ``root`` does not match its manifest (one line naming the first bad file), or None.

    Args:
        root: a checkpoint directory.
        hashes: also recompute every file's SHA-256 (each rank its share, with several ``processes``); otherwise
            only sizes are compared, which reads no file but the manifest.
        processes: every rank of the run calls this; rank 0 checks the sizes and all get the same answer (None:
            this process alone).
        require: a file the manifest must list (e.g. the recipe state's trainer_state.json).
    """
    problem, sizes, records = _agreed(_check_sizes(root, require) if leads(processes) else None, processes)
    if problem is not None or not hashes:
        return problem
    digests = hash_files(root, sizes, processes)
    for name in sizes:
        if digests[name].startswith("!"):
            return digests[name][1:]
        if digests[name] != records[name].sha256:
            return f"{root / name}: its SHA-256 differs from the manifest's (the file changed after it was written)"
    return None
