"""The benchmark and helper scripts still run against the package as it is: each one's --help imports it."""

from __future__ import annotations

import json
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


REPO = Path(__file__).resolve().parents[2]
SAVED = REPO / "bench_results" / "bench_train_against" / "06_default_vs_regressed_ac_none_quiet.json"


def test_saved_against_reports_are_redrawn_and_other_files_refused(tmp_path: Path) -> None:
    """``bench_train.py --redraw``: a saved ``--against`` report becomes a chart (nothing is run); a report of
    another kind, or a missing file, is refused in one line."""
    bench = [sys.executable, str(REPO / "scripts" / "bench_train.py"), "--redraw"]
    png = tmp_path / "chart.png"
    drawn = subprocess.run(bench + [str(SAVED), str(SAVED), "--out-png", str(png)], capture_output=True, text=True,
                           timeout=120)
    assert drawn.returncode == 0, drawn.stderr[-2000:]
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and drawn.stdout.strip() == f"wrote {png}"
    other = REPO / "bench_results" / "bench_train_profile.json"
    refused = subprocess.run(bench + [str(other), "--out-png", str(tmp_path / "no.png")], capture_output=True,
                             text=True, timeout=120)
    assert (refused.returncode, refused.stderr.strip()) == (
        1, f"bench_train --redraw: {other}: not a report of --against (it has no 'pairs')")
    missing = subprocess.run(bench + [str(tmp_path / "gone.json")], capture_output=True, text=True, timeout=120)
    assert missing.returncode == 2 and f"--redraw: no such file: {tmp_path / 'gone.json'}" in missing.stderr
    assert not (tmp_path / "no.png").exists()


def test_bench_moe_quick_finds_the_grouped_path_equal_to_the_loop(tmp_path: Path) -> None:
    out = tmp_path / "bench_moe.json"
    result = subprocess.run([sys.executable, str(REPO / "scripts" / "bench_moe.py"), "--only", "kernels", "--quick",
                             "--dtype", "fp32", "--threads", "1", "--out", str(out), "--png", str(tmp_path / "m.png")],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    report = json.loads(out.read_text())["kernels"]
    assert report["grouped_mm_runs"] is True  # CPU float32: torch._grouped_mm
    assert report["same_numbers"]["grouped"]["outputs_equal"] and report["same_numbers"]["padded_bmm"]["outputs_equal"]
    assert (tmp_path / "m.png").stat().st_size > 0
