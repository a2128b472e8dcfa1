"""What identifies a run's training data, recorded in each checkpoint (``trainer_state.json``) and checked on resume.

A resume continues the saved run only on the data it trained on: the sampler's order is a function of the number
of samples and the seed, and the position in the epoch counts batches of them. A file changed in place (cut to
1,000 of its 3,000 records, or replaced mid-epoch by other records) would make the resumed steps out of other
samples, without a word. So a checkpoint records, for each file the dataset was read from, its size and SHA-256,
and the number of samples; a resume refuses data that differs and says which file. The path itself is not part of
it: the same files moved or renamed resume. A Hugging Face Hub dataset (its files are the ``datasets`` cache's) is
identified by its name and sample count; a list of sources that holds one records its local files as above, and
its Hub datasets by name.

The files are hashed once per run, when its data is built, the ranks sharing the reading as for the manifest
(``manifest.hash_files``): about 0.8 GiB/s per rank.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Optional, Sequence

from torchtune_ac.checkpoint.manifest import hash_files
from torchtune_ac.errors import UserError
from torchtune_ac.runtime.distributed import DistributedContext

# Changed files named in a one-line message, at most.
_FILES_SHOWN = 3


def identify_data(source: str, root: Optional[Path], names: Optional[Sequence[str]], samples: int, *,
                  processes: Optional[DistributedContext] = None, hub: Sequence[str] = ()) -> dict[str, Any]:
    """The identity of a dataset: ``{"source", "root", "files": [{"name", "bytes", "sha256"}] or None,
    "samples"}``, and ``"hub"`` when the files come with Hub datasets; ``source`` and ``root`` say where the data
    was (compared only for a Hub dataset).

    Args:
        source: the dataset's source, as the config gives it.
        root: the folder ``names`` are relative to; None for a Hub dataset.
        names: the files read, in reading order; None for a Hub dataset.
        samples: the number of samples (rows, when packed) the dataset holds.
        hub: the Hub datasets read along with ``names`` (a list of sources), by name.
        processes: the run's processes: every rank calls this and the ranks share the hashing (each gets every
            digest); None: this process alone.

    Raises:
        UserError: a file cannot be read (naming it).
    """
    if root is None or names is None:
        return {"source": source, "root": None, "files": None, "samples": samples}
    sizes = {name: (root / name).stat().st_size for name in names}
    digests = hash_files(root, sizes, processes)
    unreadable = [digest[1:] for digest in digests.values() if digest.startswith("!")]
    if unreadable:
        raise UserError(f"dataset {unreadable[0]}")
    files = [{"name": name, "bytes": sizes[name], "sha256": digests[name]} for name in names]
    identity = {"source": source, "root": str(root), "files": files, "samples": samples}
    if hub:
        identity["hub"] = list(hub)
    return identity


def describe_data_change(saved: dict[str, Any], current: dict[str, Any], checkpoint: str) -> list[str]:
    """What differs between the data ``checkpoint`` trained on (``saved``) and this run's (``current``), one part
    each: a changed file (named by its path now), a file added or gone, the Hub datasets, the number of samples.
    Empty when it is the same data, wherever it lies now."""
    parts = []
    old, new = saved["files"], current["files"]
    if old is None or new is None:
        if (old, saved["source"]) != (new, current["source"]):
            parts.append(f"the source was {saved['source']} in {checkpoint}, {current['source']} now")
    else:
        root = Path(current["root"])
        changed = [f"{root / b['name']}: {a['bytes']:,} bytes (sha256 {a['sha256'][:12]}) in {checkpoint}, "
                   f"{b['bytes']:,} bytes (sha256 {b['sha256'][:12]}) now"
                   for a, b in zip(old, new) if (a["bytes"], a["sha256"]) != (b["bytes"], b["sha256"])]
        parts += changed[:_FILES_SHOWN]
        if len(changed) > _FILES_SHOWN:
            parts.append(f"{len(changed) - _FILES_SHOWN} more file(s) changed")
        parts += [f"{root / b['name']} is new" for b in new[len(old):]]
        parts += [f"{a['name']} is gone" for a in old[len(new):]]
        hub = saved.get("hub", []), current.get("hub", [])
        if hub[0] != hub[1]:
            was, now = (", ".join(names) or "none" for names in hub)
            parts.append(f"the Hub datasets were {was} in {checkpoint}, {now} now")
    if saved["samples"] != current["samples"]:
        parts.append(f"{saved['samples']:,} samples in {checkpoint}, {current['samples']:,} now")
    return parts
