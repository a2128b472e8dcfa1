"""Read dataset sources into records that remember where they came from.

Every record carries a ``location`` string (``data.jsonl:17``, ``data.json[3]``, ``notes.txt:40``,
``data.parquet row 17``) so that any later complaint about it can name the exact line, index or row in one line.
JSON, JSON Lines and text files are read here; Parquet, CSV and Arrow files, folders and Hub datasets through
Hugging Face ``datasets`` (``hf_sources.py``), chosen by :func:`load_records`.
"""

from __future__ import annotations

import codecs
import gzip
import json
import os
import re
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

from torchtune_ac.data.hf_sources import (
    check_one_format,
    folder_files,
    read_hf_file,
    read_hf_folder,
    read_hub_dataset,
)
from torchtune_ac.data.records import Record, not_utf8
from torchtune_ac.errors import UnavailableError, UserError

JSON_SUFFIXES = (".json", ".jsonl")
TEXT_SUFFIXES = (".txt", ".json", ".jsonl")
# Read through Hugging Face `datasets` (see hf_sources.py).
HF_SUFFIXES = (".parquet", ".csv", ".arrow")
# A file compressed with gzip: read as the file it holds (data.jsonl.gz).
GZIP_SUFFIX = ".gz"
# `org/name`, as on the Hugging Face Hub.
_HUB_NAME = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


@dataclass(frozen=True)
class SourceFiles:
    """The local files a dataset reads, in reading order: ``names`` (POSIX paths) relative to ``root``, the folder
    ``source`` names or the folder of the file it names (for a list of sources, the folder that holds them all);
    ``hub``, the Hugging Face Hub datasets a list of sources also reads, by name. What a checkpoint records of its
    data (each file's size and content hash, see ``checkpoint/data_identity.py``) is computed from these."""

    root: Path
    names: tuple[str, ...]
    hub: tuple[str, ...] = ()


def source_files(source: str | list[str], split: str = "train") -> Optional[SourceFiles]:
    """The local files ``load_records`` reads for ``source`` and ``split``: the file itself (compressed or not);
    for a folder, the data files of the split (or every file of a ``save_to_disk`` folder, of the split's folder
    for a ``DatasetDict``); for a list, each item's files in the list's order, and its Hub datasets in ``hub``;
    None for a Hugging Face Hub dataset, or a list of them only (their files are the ``datasets`` cache's)."""
    if isinstance(source, list):
        parts = [source_files(one, split) for one in source]
        local = [part for part in parts if part is not None]
        if not local:
            return None
        root = Path(os.path.commonpath([part.root.absolute() for part in local]))
        return SourceFiles(root, tuple((part.root.absolute() / name).relative_to(root).as_posix()
                                       for part in local for name in part.names),
                           tuple(one for one, part in zip(source, parts) if part is None))
    path = Path(source).expanduser()
    if path.is_file():
        return SourceFiles(path.parent, (path.name,))
    if path.is_dir():
        return SourceFiles(path, tuple(folder_files(path, split)))
    return None


def check_folder_formats(source: Any) -> None:
    """Refuse ``source`` if it is a folder of data files in more than one format, or a list that holds one (see
    ``hf_sources.check_one_format``); anything else passes. Reads the folder's listing only (``tune validate``).

    Raises:
        UserError: naming the files that would be left out.
    """
    if isinstance(source, list):
        for one in source:
            check_folder_formats(one)
        return
    if not isinstance(source, str) or not Path(source).expanduser().is_dir():
        return
    check_one_format(source, Path(source).expanduser())


def describe_json_type(value: Any) -> str:
    """JSON's own name for the type of a parsed value (``object``, ``array``, ``string``, ...)."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, (int, float)):
        return "number"
    if isinstance(value, str):
        return "string"
    if isinstance(value, list):
        return "array"
    return "object"


def data_suffix(path: Path) -> str:
    """The extension that says what a file holds, lower case: ``.jsonl`` for ``data.jsonl`` and ``data.jsonl.gz``."""
    if path.suffix.lower() == GZIP_SUFFIX:
        return Path(path.stem).suffix.lower()
    return path.suffix.lower()


def read_source_text(source: str, *, suffixes: tuple[str, ...]) -> tuple[Path, str]:
    """Check that ``source`` is an existing file with an allowed extension and return its text.

    A file compressed with gzip (``data.jsonl.gz``) is read as the file it holds.

    Args:
        source: Path of the file as the user wrote it.
        suffixes: Allowed extensions, lower case with the dot.

    Returns:
        The resolved path and the file's UTF-8 text, without a byte-order mark.

    Raises:
        UserError: if the file is missing, has another extension, is not gzip where it says so, or is not UTF-8.
    """
    path = Path(source).expanduser()
    if path.is_dir():
        raise UserError(f"dataset source {source} is a folder, not a file")
    if not path.is_file():  # perhaps a file of the machine that trains (tune validate warns)
        raise UnavailableError(f"dataset source {source} does not exist")
    if data_suffix(path) not in suffixes:
        found, allowed = "".join(path.suffixes[-2:]) or "(none)", ", ".join(suffixes)
        raise UserError(f"{source}: unsupported extension {found!r}; this dataset reads {allowed} files (or any of "
                        f"them compressed, {GZIP_SUFFIX})")
    try:
        data = gzip.decompress(path.read_bytes()) if path.suffix.lower() == GZIP_SUFFIX else path.read_bytes()
    except (gzip.BadGzipFile, EOFError, zlib.error) as err:
        raise UserError(f"{source}: not a gzip file, or cut short ({err})") from None
    # A byte-order mark (as Windows editors write) is dropped, not read as part of the first record.
    data = data.removeprefix(codecs.BOM_UTF8)
    try:
        return path, data.decode("utf-8")
    except UnicodeDecodeError:
        raise not_utf8(source, data.splitlines()) from None


def load_records(source: str | list[str], *, suffixes: tuple[str, ...] = JSON_SUFFIXES,
                 split: str = "train") -> list[Record]:
    """Read the records of ``source``, whatever kind of source it is.

    - a list of sources: the records of each, one after the other;
    - a ``.json``/``.jsonl`` file (or ``.txt`` where ``suffixes`` allows it), plain or gzip-compressed
      (``.jsonl.gz``): :func:`read_records`;
    - a ``.parquet``, ``.csv`` or ``.arrow`` file, a folder written by ``save_to_disk`` (``split`` chooses in a
      ``DatasetDict``), or a folder of data files: read in place through ``datasets``;
    - ``org/name`` that is not a local path: a Hugging Face Hub dataset.

    Args:
        source: Path or Hub name as the user wrote it.
        suffixes: Extensions of the hand-read files this caller accepts.
        split: Split of a folder or Hub dataset; a single file holds only ``train``.

    Returns:
        The records in order, at least one.

    Raises:
        UserError: naming the file (line, index or row) or the dataset; an empty list, or one with an item that is
            not a string.
    """
    if isinstance(source, list):
        if not source or not all(isinstance(one, str) for one in source):
            raise UserError(f"dataset source={source!r}: must be a file, folder or Hub dataset, or a non-empty list "
                            "of them (read one after the other)")
        return [record for one in source for record in load_records(one, suffixes=suffixes, split=split)]
    path = Path(source).expanduser()
    suffix = data_suffix(path)
    if path.is_file() and suffix in HF_SUFFIXES + suffixes and split != "train":
        raise UserError(f"dataset split={split!r}: {source} is a single file, which holds only the train split")
    if path.is_file() and suffix in HF_SUFFIXES and path.suffix.lower() == GZIP_SUFFIX:
        raise UserError(f"{source}: a compressed {suffix} file is not read; decompress it (gunzip {source})")
    if path.is_file() and suffix in HF_SUFFIXES:
        return read_hf_file(source, path)
    if path.is_dir():
        return read_hf_folder(source, path, split)
    if is_hub_name(source, suffixes):
        return read_hub_dataset(source, split)
    return read_records(source, suffixes=suffixes + HF_SUFFIXES)


def is_hub_name(source: str, suffixes: tuple[str, ...] = JSON_SUFFIXES) -> bool:
    """Whether ``load_records`` reads ``source`` as a Hugging Face Hub dataset: ``org/name``, and no such local path.
    """
    path = Path(source).expanduser()
    return not path.exists() and data_suffix(path) not in HF_SUFFIXES + suffixes and bool(_HUB_NAME.match(source))


def read_records(source: str, *, suffixes: tuple[str, ...] = JSON_SUFFIXES) -> list[Record]:
    """Read a ``.jsonl`` (one object per line), ``.json`` (an array of objects) or ``.txt`` source.

    A ``.txt`` file is split into documents at blank lines; each record's value is the document text and its
    location the line it starts on. Blank lines in ``.jsonl`` files are skipped.

    Args:
        source: Path of the file.
        suffixes: Extensions this caller accepts.

    Returns:
        The records in file order, at least one.

    Raises:
        UserError: for a missing file, an unsupported extension, malformed JSON (with line), a record that is not a
            JSON object, or a file with no records.
    """
    path, text = read_source_text(source, suffixes=suffixes)
    suffix = data_suffix(path)
    if suffix == ".jsonl":
        records = parse_jsonl(source, text)
    elif suffix == ".json":
        records = parse_json_array(source, text)
    else:
        records = split_text_documents(source, text)
    if not records:
        raise UserError(f"{source}: the file holds no records")
    return records


def parse_jsonl(source: str, text: str) -> list[Record]:
    """Parse one JSON object per non-blank line; ``source`` only names the file in errors."""
    records = []
    for lineno, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            value = json.loads(line)
        except json.JSONDecodeError as e:
            raise UserError(f"{source}:{lineno}: invalid JSON: {e.msg} (column {e.colno})") from None
        if not isinstance(value, dict):
            raise UserError(f"{source}:{lineno}: each line must be a JSON object, got {describe_json_type(value)}")
        records.append(Record(f"{source}:{lineno}", value))
    return records


def parse_json_array(source: str, text: str) -> list[Record]:
    """Parse a JSON array of objects; records are located by their index, ``data.json[3]``.

    A ``.json`` file holding one object per line (JSON Lines, which Hugging Face's ``json`` loader also reads
    from ``.json`` files) is parsed as JSON Lines.
    """
    try:
        values = json.loads(text)
    except json.JSONDecodeError as e:
        if e.msg == "Extra data" and text.lstrip().startswith("{"):
            return parse_jsonl(source, text)
        raise UserError(f"{source}:{e.lineno}: invalid JSON: {e.msg} (column {e.colno})") from None
    if not isinstance(values, list):
        raise UserError(f"{source}: must hold a JSON array of objects, got {describe_json_type(values)}")
    records = []
    for index, value in enumerate(values):
        if not isinstance(value, dict):
            raise UserError(f"{source}[{index}]: each record must be a JSON object, got {describe_json_type(value)}")
        records.append(Record(f"{source}[{index}]", value))
    return records


def split_text_documents(source: str, text: str) -> list[Record]:
    """Split text into documents at blank (or whitespace-only) lines, keeping the inner line breaks."""
    records = []
    lines: list[str] = []
    start = 0
    for lineno, line in enumerate(text.splitlines(), start=1):
        if line.strip():
            if not lines:
                start = lineno
            lines.append(line)
        elif lines:
            records.append(Record(f"{source}:{start}", "\n".join(lines)))
            lines = []
    if lines:
        records.append(Record(f"{source}:{start}", "\n".join(lines)))
    return records
