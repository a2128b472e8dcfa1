"""What a dataset source is read into, below both of its readers (``sources.py``, ``hf_sources.py``): a record that
remembers where it came from, and the one-line error for a file that is not UTF-8 text."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable

from torchtune_ac.errors import UserError


@dataclass(frozen=True)
class Record:
    """One record of a source file: ``value`` is a dict (JSON/JSONL) or a document string (.txt)."""

    location: str
    value: Any


def not_utf8(source: str, lines: Iterable[bytes]) -> UserError:
    """The error for a file that is not UTF-8 text: the first line that does not decode, and where in it (a byte
    offset into the file means little to whoever opens it in an editor)."""
    for lineno, line in enumerate(lines, start=1):
        try:
            line.decode("utf-8")
        except UnicodeDecodeError as err:
            column = len(line[:err.start].decode("utf-8", errors="replace")) + 1
            return UserError(f"{source}:{lineno}: not UTF-8 text: byte {line[err.start]:#04x} at column {column} "
                             f"({err.reason}); the file must be UTF-8 encoded: convert it, for example with iconv -f "
                             "LATIN1 -t UTF-8")
    return UserError(f"{source}: not UTF-8 text; the file must be UTF-8 encoded")
