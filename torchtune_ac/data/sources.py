"""Read dataset sources into records that remember where they came from.

Every record carries a ``location`` string (``data.jsonl:17``, ``data.json[3]``, ``notes.txt:40``,
``data.parquet row 17``) so that any later complaint about it can name the exact line, index or row in one line.
JSON, JSON Lines and text files are read here; Parquet, CSV and Arrow files, folders and Hub datasets through
Hugging Face ``datasets`` (``hf_sources.py``), chosen by :func:`load_records`.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

from torchtune_ac.errors import UserError

JSON_SUFFIXES = (".json", ".jsonl")
TEXT_SUFFIXES = (".txt", ".json", ".jsonl")
# Read through Hugging Face `datasets` (see hf_sources.py).
HF_SUFFIXES = (".parquet", ".csv", ".arrow")
# `org/name`, as on the Hugging Face Hub.
_HUB_NAME = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


@dataclass(frozen=True)
class SourceFiles:
    """The local files a dataset reads, in reading order: ``names`` (POSIX paths) relative to ``root``, the folder
    ``source`` names or the folder of the file it names. What a checkpoint records of its data (each file's size
    and content hash, see ``checkpoint/data_identity.py``) is computed from these."""

    root: Path
    names: tuple[str, ...]


def source_files(source: str, split: str = "train") -> Optional[SourceFiles]:
    """The local files ``load_records`` reads for ``source`` and ``split``: the file itself; for a folder, the
    data files of the split (or every file of a ``save_to_disk`` folder, of the split's folder for a
    ``DatasetDict``); None for a Hugging Face Hub dataset (its files are the ``datasets`` cache's)."""
    path = Path(source).expanduser()
    if path.is_file():
        return SourceFiles(path.parent, (path.name,))
    if path.is_dir():
        from torchtune_ac.data.hf_sources import folder_files

        return SourceFiles(path, tuple(folder_files(path, split)))
    return None


def check_folder_formats(source: Any) -> None:
    """Refuse ``source`` if it is a folder of data files in more than one format (see
    ``hf_sources.check_one_format``); anything else passes. Reads the folder's listing only (``tune validate``).

    Raises:
        UserError: naming the files that would be left out.
    """
    if not isinstance(source, str) or not Path(source).expanduser().is_dir():
        return
    from torchtune_ac.data.hf_sources import check_one_format

    check_one_format(source, Path(source).expanduser())


@dataclass(frozen=True)
class Record:
    """One record of a source file: ``value`` is a dict (JSON/JSONL) or a document string (.txt)."""

    location: str
    value: Any


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


def read_source_text(source: str, *, suffixes: tuple[str, ...]) -> tuple[Path, str]:
    """Check that ``source`` is an existing file with an allowed extension and return its text.

    Args:
        source: Path of the file as the user wrote it.
        suffixes: Allowed extensions, lower case with the dot.

    Returns:
        The resolved path and the file's UTF-8 text, without a byte-order mark.

    Raises:
        UserError: if the file is missing, has another extension, or is not UTF-8.
    """
    path = Path(source).expanduser()
    if not path.is_file():
        reason = "is a folder, not a file" if path.is_dir() else "does not exist"
        raise UserError(f"dataset source {source} {reason}")
    if path.suffix.lower() not in suffixes:
        found, allowed = path.suffix or "(none)", ", ".join(suffixes)
        raise UserError(f"{source}: unsupported extension {found!r}; this dataset reads {allowed} files")
    try:
        # utf-8-sig: a byte-order mark (as Windows editors write) is dropped, not read as part of the first record.
        return path, path.read_text(encoding="utf-8-sig")
    except UnicodeDecodeError as e:
        raise UserError(f"{source}: not UTF-8 text ({e.reason} at byte {e.start})") from None


def load_records(source: str, *, suffixes: tuple[str, ...] = JSON_SUFFIXES, split: str = "train") -> list[Record]:
    """Read the records of ``source``, whatever kind of source it is.

    - a ``.json``/``.jsonl`` file (or ``.txt`` where ``suffixes`` allows it): :func:`read_records`;
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
        UserError: naming the file (line, index or row) or the dataset.
    """
    path = Path(source).expanduser()
    suffix = path.suffix.lower()
    if path.is_file() and suffix in HF_SUFFIXES + suffixes and split != "train":
        raise UserError(f"dataset split={split!r}: {source} is a single file, which holds only the train split")
    if path.is_file() and suffix in HF_SUFFIXES:
        from torchtune_ac.data.hf_sources import read_hf_file

        return read_hf_file(source, path)
    if path.is_dir():
        from torchtune_ac.data.hf_sources import read_hf_folder

        return read_hf_folder(source, path, split)
    if is_hub_name(source, suffixes):
        from torchtune_ac.data.hf_sources import read_hub_dataset

        return read_hub_dataset(source, split)
    return read_records(source, suffixes=suffixes + HF_SUFFIXES)


def is_hub_name(source: str, suffixes: tuple[str, ...] = JSON_SUFFIXES) -> bool:
    """Whether ``load_records`` reads ``source`` as a Hugging Face Hub dataset: ``org/name``, and no such local path.
    """
    path = Path(source).expanduser()
    return not path.exists() and path.suffix.lower() not in HF_SUFFIXES + suffixes and bool(_HUB_NAME.match(source))


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
    suffix = path.suffix.lower()
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
