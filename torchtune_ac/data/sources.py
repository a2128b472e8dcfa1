"""Read local dataset files into records that remember where they came from.

Every record carries a ``location`` string (``data.jsonl:17``, ``data.json[3]``, ``notes.txt:40``) so that
any later complaint about it can name the exact line or array index in one line.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from torchtune_ac.errors import UserError

JSON_SUFFIXES = (".json", ".jsonl")
TEXT_SUFFIXES = (".txt", ".json", ".jsonl")


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
        The resolved path and the file's UTF-8 text.

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
        return path, path.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise UserError(f"{source}: not UTF-8 text ({e.reason} at byte {e.start})") from None


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
    """Parse a JSON array of objects; records are located by their index, ``data.json[3]``."""
    try:
        values = json.loads(text)
    except json.JSONDecodeError as e:
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
