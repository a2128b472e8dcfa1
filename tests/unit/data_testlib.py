"""Helpers the data tests share (importable: this folder is on ``sys.path``, see ``conftest.py``)."""

from __future__ import annotations

import json
from pathlib import Path


def write_jsonl(path: Path, records: list) -> str:
    """Write ``records`` one JSON object a line to ``path``; returns the path as a string (a dataset's source)."""
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return str(path)
