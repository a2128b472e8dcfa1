"""The benchmark and helper scripts still run against the package as it is: each one's --help imports it."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

# Every script, at the top and in scripts/bench/ and scripts/gpu/; files starting with "_" are libraries the scripts
# share, not scripts.
SCRIPTS = sorted(s for s in (Path(__file__).resolve().parents[2] / "scripts").rglob("*.py")
                 if not s.name.startswith("_"))


# One interpreter runs every script's --help in turn (as __main__, with its folder first on sys.path, as `python
# script.py --help` would have it), each one's exit status and output kept apart: a fresh interpreter per script
# spent its seconds importing torch and the package again.
EVERY_HELP = """
import contextlib, io, json, os, runpy, sys, traceback
results = {}
for path in sys.argv[1:]:
    out, err, saved = io.StringIO(), io.StringIO(), (list(sys.argv), list(sys.path))
    sys.argv, sys.path[:0] = [path, "--help"], [os.path.dirname(path)]
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            runpy.run_path(path, run_name="__main__")
        code = 0
    except SystemExit as stop:
        code = stop.code if isinstance(stop.code, int) else (0 if stop.code is None else 1)
    except BaseException:
        code = 1
        err.write(traceback.format_exc())
    finally:
        sys.argv, sys.path[:] = saved
    results[path] = [code, out.getvalue(), err.getvalue()]
sys.__stdout__.write(json.dumps(results))
"""


@pytest.fixture(scope="module")
def every_help() -> dict[str, list]:
    result = subprocess.run([sys.executable, "-c", EVERY_HELP, *map(str, SCRIPTS)], capture_output=True, text=True,
                            timeout=600)
    assert result.returncode == 0, result.stderr[-2000:]
    return json.loads(result.stdout)


@pytest.mark.parametrize("script", SCRIPTS, ids=[s.name for s in SCRIPTS])
def test_script_starts(script: Path, every_help: dict[str, list]) -> None:
    code, stdout, stderr = every_help[str(script)]
    assert code == 0, stderr[-2000:]
    assert "usage:" in stdout


REPO = Path(__file__).resolve().parents[2]
SAVED = REPO / "bench_results" / "bench_train_against" / "06_default_vs_regressed_ac_none_quiet.json"


def test_saved_against_reports_are_redrawn_and_other_files_refused(tmp_path: Path) -> None:
    """``bench_train.py --redraw``: a saved ``--against`` report becomes a chart (nothing is run); a report of
    another kind, or a missing file, is refused in one line."""
    bench = [sys.executable, str(REPO / "scripts" / "bench" / "bench_train.py"), "--redraw"]
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
    bench_moe = REPO / "scripts" / "bench" / "bench_moe.py"
    result = subprocess.run([sys.executable, str(bench_moe), "--only", "kernels", "--quick",
                             "--dtype", "fp32", "--threads", "1", "--out", str(out), "--png", str(tmp_path / "m.png")],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    report = json.loads(out.read_text())["kernels"]
    assert report["grouped_mm_runs"] is True  # CPU float32: torch._grouped_mm
    assert report["same_numbers"]["grouped"]["outputs_equal"] and report["same_numbers"]["padded_bmm"]["outputs_equal"]
    assert (tmp_path / "m.png").stat().st_size > 0


def test_dpo_speed_times_the_steps_after_warm_up_and_refuses_steps_that_held_other_pairs() -> None:
    """``bench_dpo.py --only speed``'s reading of a run: the steps after the warm-up, their pairs (in order, or a
    packed step's rows' pairs) and real tokens; a run whose steps' answer tokens are not those pairs' is refused."""
    import _dpo_speed

    data = {"pair_tokens": [10, 20, 30, 40, 50, 60], "answer_tokens": [4, 8, 12, 16, 20, 24],
            "row_pairs": [(0, 2), (2, 3), (3, 6)]}
    padded = {"step_seconds": [9.0, 2.0, 3.0], "step_answer_tokens": [12, 28, 44], "peak_gib": 1.0, "batch_size": 2}
    reading = _dpo_speed.account("padded", padded, data, warmup=1)
    assert (reading["steps"], reading["pairs"], reading["tokens"], reading["seconds"]) == (2, 4, 180, 5.0)
    assert reading["tokens_per_s"] == 36.0 and reading["warmup_s"] == 9.0
    packed = {"step_seconds": [5.0, 1.5, 2.5], "step_answer_tokens": [12, 12, 60], "peak_gib": 1.0, "batch_size": 1}
    reading = _dpo_speed.account("packed", packed, data, warmup=1)
    assert (reading["steps"], reading["pairs"], reading["tokens"], reading["seconds"]) == (2, 4, 180, 4.0)
    shuffled = {**padded, "step_answer_tokens": [28, 12, 44]}
    with pytest.raises(RuntimeError, match="not those of the pairs in order"):
        _dpo_speed.account("trl", shuffled, data, warmup=1)
    with pytest.raises(RuntimeError, match="none left after 3 warm-up"):
        _dpo_speed.account("padded", padded, data, warmup=3)
