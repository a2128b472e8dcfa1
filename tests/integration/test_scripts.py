"""The benchmark and helper scripts still run against the package as it is: each one's --help imports it."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

# Files starting with "_" are libraries the scripts share, not scripts.
SCRIPTS = sorted(s for s in (Path(__file__).resolve().parents[2] / "scripts").glob("*.py") if not s.name.startswith("_"))


@pytest.mark.parametrize("script", SCRIPTS, ids=[s.name for s in SCRIPTS])
def test_script_starts(script: Path) -> None:
    result = subprocess.run([sys.executable, str(script), "--help"], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    assert "usage:" in result.stdout
