"""The GPU check's plumbing, on a CPU (``scripts/gpu_check.sh``, ``scripts/gpu_report.py``): a GPU is lent for
minutes, so what a CPU can show fails here first.

* Bad arguments exit 2 with one line, before anything is written; without CUDA the check stops at once (exit 1).
* The report turns each stage's JUnit XML into counts, and a stage whose XML is missing or cut short (pytest killed
  while writing it) is named, the other stages still reported.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "scripts" / "gpu_check.sh"


def gpu_check(*args: str, cwd: Path = REPO) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHON": sys.executable}
    return subprocess.run(["bash", str(SCRIPT), *args], capture_output=True, text=True, env=env, cwd=cwd,
                          timeout=300)


@pytest.mark.parametrize("args", [["--bogus"], ["--out"], ["--out="], ["--only"], ["--only="],
                                  ["--only", "fast,nope"], ["--out", "OUT", "--only", "compile"]])
def test_bad_arguments_exit_2_with_one_line_and_write_nothing(args: list[str], tmp_path: Path) -> None:
    before = written_by_default()
    result = gpu_check(*[str(tmp_path / a) if a == "OUT" else a for a in args])
    assert result.returncode == 2, (result.returncode, result.stderr)
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("gpu_check: ") and "(see --help)" in lines[0], result.stderr
    assert result.stdout == "" and not (tmp_path / "OUT").exists()
    assert written_by_default() == before


def written_by_default() -> dict[str, float]:
    """What an empty ``--out`` would write to (the repository root) and the default output folder hold."""
    return {str(p): p.stat().st_mtime for folder in (REPO, REPO / "bench_results") for p in folder.glob("gpu_*")}


def test_help_exits_0_and_names_every_option() -> None:
    result = gpu_check("--help")
    assert result.returncode == 0, result.stderr
    for option in ("--out DIR", "--full", "--only", "PYTHON"):
        assert option in result.stdout, option
    assert "set -uo" not in result.stdout  # the comment block alone


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")
def test_without_cuda_it_stops_before_any_stage_with_exit_1(tmp_path: Path) -> None:
    result = gpu_check("--out", str(tmp_path / "out"))
    assert result.returncode == 1, result.stderr
    assert result.stdout.strip().splitlines()[-1] == "gpu_check: no CUDA device", result.stdout
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["gpu_check.log"]
    assert "stage" not in (tmp_path / "out" / "gpu_check.log").read_text()


# ---------------------------------------------------------------------------------------------------- the report

STAGE_TESTS = """
import pytest

def test_passes():
    assert True

def test_fails():
    assert 1 == 2, "one is not two"

@pytest.mark.skip(reason="not here")
def test_skipped():
    pass
"""


def test_the_report_counts_each_stage_and_names_missing_and_unreadable_xml(tmp_path: Path) -> None:
    (tmp_path / "test_stage.py").write_text(STAGE_TESTS)
    subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-o", "addopts=",
                    "--rootdir", str(tmp_path), "--junitxml", str(tmp_path / "gpu_fast.xml"),
                    str(tmp_path / "test_stage.py")], capture_output=True, text=True, cwd=tmp_path, timeout=120)
    whole = (tmp_path / "gpu_fast.xml").read_text()
    (tmp_path / "gpu_offload.xml").write_text(whole[: len(whole) // 2])  # killed while writing it
    (tmp_path / "gpu_bench.xml").write_text("")
    out = tmp_path / "report" / "gpu_tests.json"
    result = subprocess.run([sys.executable, str(REPO / "scripts" / "gpu_report.py"), "--out", str(out),
                             *(str(tmp_path / f"gpu_{stage}.xml") for stage in ("fast", "offload", "compiled", "bench"))],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0 and "Traceback" not in result.stderr, result.stderr
    report = json.loads(out.read_text())
    assert report["counts"] == {"passed": 1, "failed": 1, "error": 0, "skipped": 1}
    assert {t["test"].rsplit("::", 1)[1]: t["outcome"] for t in report["tests"]} == {
        "test_passes": "passed", "test_fails": "failed", "test_skipped": "skipped"}
    assert all(t["stage"] == "fast" for t in report["tests"])
    assert "one is not two" in next(t["message"] for t in report["tests"] if t["outcome"] == "failed")
    assert report["missing_stages"] == ["gpu_compiled.xml"]
    assert sorted(report["unreadable_stages"]) == ["gpu_bench.xml", "gpu_offload.xml"]
    assert "unreadable XML from gpu_offload.xml, gpu_bench.xml" in result.stdout
