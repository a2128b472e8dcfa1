"""Dataset sources read through Hugging Face ``datasets``: Parquet, CSV and Arrow files, ``save_to_disk``
folders, folders of data files, and Hub datasets.

Local files are streamed (read in place: no Arrow copy in the ``datasets`` cache, and nothing written next to
them); a Hub dataset is downloaded into the ``datasets`` cache (``HF_DATASETS_CACHE``, under ``HF_HOME``) as
``datasets`` always does, so it can be read again offline. ``datasets`` is imported only when one of these
sources is used. Every record keeps where it came from: ``data.parquet row 17`` (0-based, as
``dataset[17]``), ``data.csv:19`` (the line, when no field spans lines), ``folder [train] row 3``.
"""

from __future__ import annotations

import contextlib
import csv
import json
import os
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, Optional

from torchtune_ac.data.records import Record, not_utf8
from torchtune_ac.errors import UserError

# Seconds to wait for the Hub's answer to the one request that tells whether it can be reached.
_HUB_PROBE_TIMEOUT_S = 5.0
# File extension -> the `datasets` builder that reads it.
HF_FILE_BUILDERS = {".parquet": "parquet", ".csv": "csv", ".arrow": "arrow"}
# Written by Dataset.save_to_disk / DatasetDict.save_to_disk.
SAVED_DATASET_FILE = "state.json"
SAVED_DATASET_DICT_FILE = "dataset_dict.json"
# Files named in a one-line message, at most.
_FILES_SHOWN = 5


def _datasets():
    import datasets

    # Progress bars would fill non-terminal logs with carriage returns (the recipe prints its own progress).
    datasets.disable_progress_bars()
    return datasets


def _read_errors() -> tuple[type[BaseException], ...]:
    """Exceptions that mean "this data cannot be read" (malformed file, wrong format), not a bug here."""
    import pyarrow

    datasets = _datasets()
    return (ValueError, OSError, pyarrow.ArrowException, datasets.exceptions.DatasetGenerationError)


def _first_line(err: BaseException) -> str:
    text = str(err).strip().splitlines()
    return text[0] if text else type(err).__name__


def _records(rows: Iterable[dict[str, Any]], location: Callable[[int], str], source: str) -> list[Record]:
    records = [Record(location(index), dict(row)) for index, row in enumerate(rows)]
    if not records:
        raise UserError(f"{source}: the dataset holds no records")
    return records


def read_hf_file(source: str, path: Path) -> list[Record]:
    """Read a ``.parquet``, ``.csv`` or ``.arrow`` file.

    CSV cells are read as strings, empty cells as empty strings (not nulls), whatever pandas would infer.

    Raises:
        UserError: a file ``datasets`` cannot read, or one with no rows.
    """
    builder = HF_FILE_BUILDERS[path.suffix.lower()]
    datasets = _datasets()
    options: dict[str, Any] = {}
    if builder == "csv":
        header = _csv_header(source, path)
        options = {"na_filter": False,
                   "features": datasets.Features({name: datasets.Value("string") for name in header})}
    try:
        stream = datasets.load_dataset(builder, data_files=str(path), split="train", streaming=True, **options)
        rows = list(stream)
    except UnicodeDecodeError:
        raise _not_utf8(source, path) from None
    except _read_errors() as err:
        raise UserError(f"{source}: cannot read it as {builder}: {_first_line(err)}") from None
    if builder == "csv" and _count_lines(path) == len(rows) + 1:
        # One line per row after the header (no field spans lines): name the line, as for JSONL.
        return _records(rows, lambda index: f"{source}:{index + 2}", source)
    return _records(rows, lambda index: f"{source} row {index}", source)


def _csv_header(source: str, path: Path) -> list[str]:
    try:
        with path.open(newline="", encoding="utf-8") as file:
            header = next(csv.reader(file), None)
    except UnicodeDecodeError:
        raise _not_utf8(source, path) from None
    if not header:
        raise UserError(f"{source}: the file holds no records (no header line)")
    return header


def _not_utf8(source: str, path: Path) -> UserError:
    """The error naming the first line of ``path`` that is not UTF-8 (read line by line, not held whole)."""
    with path.open("rb") as file:
        return not_utf8(source, file)


def _count_lines(path: Path) -> int:
    """Lines in the file, a last line without a newline included."""
    count, last = 0, b"\n"
    with path.open("rb") as file:
        for chunk in iter(lambda: file.read(1 << 20), b""):
            count += chunk.count(b"\n")
            last = chunk[-1:]
    return count + (last != b"\n")


def read_hf_folder(source: str, path: Path, split: str) -> list[Record]:
    """Read a folder: one written by ``save_to_disk`` (a ``Dataset``, or a ``DatasetDict`` from which ``split``
    is taken), or a folder of data files (Parquet, CSV, JSON Lines, ...; ``split`` picked by file names as
    ``datasets.load_dataset`` does, e.g. ``train-00000-of-00001.parquet``).

    Raises:
        UserError: no such split (listing those there are), no data files, or unreadable data.
    """
    datasets = _datasets()
    errors = _read_errors()
    if (path / SAVED_DATASET_DICT_FILE).is_file():
        # Only the split's own folder is read: `load_from_disk` of the whole DatasetDict fails (an IndexError
        # inside `datasets`) on any split saved with no rows, even one that is not read.
        splits = _saved_splits(source, path)
        if split not in splits:
            raise UserError(f"{source}: no split {split!r} (the saved dataset has: {', '.join(splits)}); set split")
        saved = _load_saved(f"{source} [{split}]", path / split)
        return _records(saved, lambda index: f"{source} [{split}] row {index}", f"{source} [{split}]")
    if (path / SAVED_DATASET_FILE).is_file():
        if split != "train":
            raise UserError(f"{source}: split={split!r}, but the folder holds one saved dataset, not a DatasetDict")
        return _records(_load_saved(source, path), lambda index: f"{source} row {index}", source)
    check_one_format(source, path)
    try:
        rows = list(datasets.load_dataset(str(path), split=split, streaming=True))
    except (datasets.exceptions.DataFilesNotFoundError, datasets.data_files.EmptyDatasetError):
        raise UserError(f"{source}: the folder holds no data files (.parquet, .csv, .jsonl, ...) and no dataset "
                        "written by save_to_disk") from None
    except errors as err:
        message = _first_line(err)
        if "split" in message.lower() and split in message:
            raise UserError(f"{source}: {message}; set split") from None
        raise UserError(f"{source}: cannot read the folder's data files: {message}") from None
    return _records(rows, lambda index: f"{source} [{split}] row {index}", f"{source} [{split}]")


def _saved_splits(source: str, path: Path) -> list[str]:
    """The splits a ``DatasetDict.save_to_disk`` folder lists in its ``dataset_dict.json``."""
    try:
        splits = json.loads((path / SAVED_DATASET_DICT_FILE).read_text(encoding="utf-8"))["splits"]
    except (OSError, ValueError, KeyError, TypeError) as err:
        raise UserError(f"{source}: cannot read the saved dataset's {SAVED_DATASET_DICT_FILE}: "
                        f"{_first_line(err)}") from None
    return [str(name) for name in splits]


def _load_saved(source: str, path: Path) -> Any:
    """``datasets.load_from_disk`` of one saved ``Dataset``; one saved with no rows (no Arrow file, which
    ``datasets`` fails on with an IndexError) is refused as holding no records."""
    datasets = _datasets()
    try:
        state = json.loads((path / SAVED_DATASET_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError) as err:
        raise UserError(f"{source}: cannot read the saved dataset: {_first_line(err)}") from None
    if isinstance(state, dict) and state.get("_data_files") == []:
        raise UserError(f"{source}: the dataset holds no records")
    try:
        return datasets.load_from_disk(str(path))
    except _read_errors() as err:
        raise UserError(f"{source}: cannot read the saved dataset: {_first_line(err)}") from None


def _folder_data_files(path: Path) -> dict[str, list[Path]]:
    """split -> the data files ``datasets.load_dataset(folder)`` finds for it, by its own patterns (``train-*``,
    ``data/test/...``; every file for ``train`` when no name says a split), whatever their format; {} with none."""
    from datasets.data_files import DataFilesDict, EmptyDatasetError, get_data_patterns

    # `datasets` names the files by absolute path; they are given back under `path` as the user wrote it (a
    # relative folder stays relative), so that `relative_to(path)` holds.
    base = os.path.abspath(path)
    try:
        found = DataFilesDict.from_patterns(get_data_patterns(base), base_path=base)
    except (EmptyDatasetError, FileNotFoundError):
        return {}
    return {str(split): [path / Path(name).relative_to(base) for name in names] for split, names in found.items()}


def _formats(files: list[Path]) -> dict[str, list[Path]]:
    """``datasets`` builder -> the files it would read (``json`` for .json, .jsonl and .jsonl.gz alike); files no
    builder reads are left out."""
    from datasets.load import infer_module_for_data_files_list

    by_builder: dict[str, list[Path]] = {}
    for file in files:
        builder, _ = infer_module_for_data_files_list([str(file)])
        if builder is not None:
            by_builder.setdefault(builder, []).append(file)
    return by_builder


def check_one_format(source: str, path: Path) -> None:
    """Refuse a folder of data files in more than one format: ``datasets`` reads the folder in the format of most
    of its files and leaves the others out, without a word (3,000 records of ``a.jsonl`` dropped for the 100 of
    ``b.parquet``). A ``save_to_disk`` folder is one dataset, and is not checked.

    Raises:
        UserError: naming the format that would be read and the files that would be left out.
    """
    if (path / SAVED_DATASET_FILE).is_file() or (path / SAVED_DATASET_DICT_FILE).is_file():
        return
    from datasets.load import infer_module_for_data_files_list

    files = sorted({file for split_files in _folder_data_files(path).values() for file in split_files})
    by_builder = _formats(files)
    if len(by_builder) <= 1:
        return
    chosen, _ = infer_module_for_data_files_list([str(file) for file in files])
    left_out = sorted(file.relative_to(path).as_posix() for builder, group in by_builder.items() if builder != chosen
                      for file in group)
    shown = ", ".join(left_out[:_FILES_SHOWN]) + (f" and {len(left_out) - _FILES_SHOWN} more"
                                                  if len(left_out) > _FILES_SHOWN else "")
    raise UserError(
        f"dataset source {source}: holds data files in {len(by_builder)} formats ("
        + ", ".join(f"{len(group)} {builder}" for builder, group in sorted(by_builder.items()))
        + f"), and a folder is read in one format only: the {len(by_builder[chosen])} {chosen} file(s) would be read "
        f"and {shown} left out; keep one format in the folder (convert the others), or point source at one file"
    )


def folder_files(path: Path, split: str) -> list[Path]:
    """The files a folder source is read from for ``split``, relative to ``path``, in reading order: every file
    of a ``save_to_disk`` folder (of the split's folder for a ``DatasetDict``), else the split's data files."""
    if (path / SAVED_DATASET_DICT_FILE).is_file():
        root = path / split
        files = sorted(file for file in root.rglob("*") if file.is_file())
    elif (path / SAVED_DATASET_FILE).is_file():
        files = sorted(file for file in path.rglob("*") if file.is_file())
    else:
        files = _folder_data_files(path).get(split, [])
        read = {file for group in _formats(files).values() for file in group}
        files = [file for file in files if file in read]
    return [file.relative_to(path).as_posix() for file in files]


def read_hub_dataset(name: str, split: str) -> list[Record]:
    """Download (or reuse from the cache) the Hub dataset ``name`` and read its ``split``.

    Unless offline mode is on (``HF_HUB_OFFLINE=1``), the Hub is asked once, with no retry, whether it can be
    reached: if not, a cached copy is read in offline mode, and without one the run stops at once. (Left to
    itself, ``datasets`` retries every request with back-off: 30 s and a screenful of retry lines before the
    same conclusion.)

    Raises:
        UserError: one line when the Hub cannot be reached (or offline mode is on) and the dataset is not in the
            cache, the dataset does not exist, or its data cannot be read.
    """
    datasets = _datasets()
    offline = bool(datasets.config.HF_HUB_OFFLINE)
    fix = "download it first (the cache is then read offline too) or point source at local files"
    if not offline:
        problem = _hub_unreachable()
        if problem is not None:
            if _cached_hub_dataset(name) is None:
                raise UserError(f"dataset source {name}: not a local file or folder, not in the datasets cache "
                                f"({datasets.config.HF_DATASETS_CACHE}), and the Hugging Face Hub cannot be reached "
                                f"({problem}); {fix}")
            offline = True
    try:
        with _hub_offline(offline):
            loaded = datasets.load_dataset(name, split=split)
    except datasets.exceptions.DatasetNotFoundError:
        raise UserError(f"dataset source {name}: no such local file or folder, nor dataset on the Hugging Face "
                        "Hub") from None
    except ConnectionError:
        raise UserError(f"dataset source {name}: not a local file or folder, and not in the datasets cache "
                        f"({datasets.config.HF_DATASETS_CACHE}) while HF_HUB_OFFLINE is set; {fix}") from None
    except _read_errors() as err:
        raise UserError(f"dataset source {name}: {_first_line(err)}") from None
    return _records(loaded, lambda index: f"{name} [{split}] row {index}", f"{name} [{split}]")


def describe_hub_source(name: str) -> tuple[str, Optional[str]]:
    """What a run will do with the Hub dataset ``name`` (``tune validate``'s summary line), and a warning when it
    cannot work here: offline mode is on and the dataset is not cached. Reads nothing from the network.
    """
    datasets = _datasets()
    cached = _cached_hub_dataset(name)
    offline = bool(datasets.config.HF_HUB_OFFLINE)
    where = (f"in the datasets cache ({cached})" if cached is not None
             else f"not in the datasets cache ({datasets.config.HF_DATASETS_CACHE})")
    if offline:
        summary = f"{name}: a Hugging Face Hub dataset, {where}; HF_HUB_OFFLINE is set: the run reads the cache only"
        warning = None if cached is not None else (f"dataset source {name}: HF_HUB_OFFLINE is set and the dataset is "
                                                   "not in the datasets cache: the run will stop")
        return summary, warning
    action = "read from the cache" if cached is not None else "downloaded"
    return f"{name}: a Hugging Face Hub dataset, {where}; {action} when the run starts", None


def _hub_unreachable() -> Optional[str]:
    """Why the Hugging Face Hub cannot be reached from here, asking it once (no retries), or None if it can."""
    from huggingface_hub import constants
    from huggingface_hub.utils import get_session

    try:
        get_session().head(constants.ENDPOINT, timeout=_HUB_PROBE_TIMEOUT_S)
    except Exception as err:  # noqa: BLE001 - whatever the HTTP library raises, the Hub is not reachable
        return f"{constants.ENDPOINT}: {_first_line(err)}"
    return None


def _cached_hub_dataset(name: str) -> Optional[Path]:
    """The folder of ``datasets``' cache that holds a copy of the Hub dataset ``name``, or None (its layout:
    ``<cache>/<org>___<name>/<config>/<version>/<hash>/``)."""
    from datasets.naming import camelcase_to_snakecase

    datasets = _datasets()
    org, _, short = name.partition("/")
    root = Path(datasets.config.HF_DATASETS_CACHE) / f"{org}___{camelcase_to_snakecase(short)}"
    return root if root.is_dir() and any(p.is_dir() for p in root.glob("*/*/*")) else None


@contextlib.contextmanager
def _hub_offline(offline: bool) -> Iterator[None]:
    """Offline mode for ``datasets`` and ``huggingface_hub`` while the body runs (both read the flag at import from
    ``HF_HUB_OFFLINE``, and again on each request from their module attribute)."""
    if not offline:
        yield
        return
    from huggingface_hub import constants

    datasets = _datasets()
    saved = constants.HF_HUB_OFFLINE, datasets.config.HF_HUB_OFFLINE
    constants.HF_HUB_OFFLINE = datasets.config.HF_HUB_OFFLINE = True
    try:
        yield
    finally:
        constants.HF_HUB_OFFLINE, datasets.config.HF_HUB_OFFLINE = saved
