"""The GPU check's plumbing, on a CPU (``scripts/gpu_check.sh``, ``scripts/gpu_report.py``): a GPU is lent for
minutes, so what a CPU can show fails here first.

* The report turns each stage's JUnit XML into counts, and a stage whose XML is missing or cut short (pytest killed
  while writing it) is named, the other stages still reported.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


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
