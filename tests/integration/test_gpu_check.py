"""The GPU check's plumbing, on a CPU (``scripts/gpu/gpu_check.sh``, ``scripts/gpu/gpu_report.py``): a GPU is lent for
minutes, so what a CPU can show fails here first.

* Bad arguments exit 2 with one line, before anything is written; without CUDA the check stops at once (exit 1).
* ``--list``: every ``cuda``-marked test of the suite is in exactly one pytest stage of ``--full``, and the default
  run is the short stages whole (fitting 300 s with its kill margins; the others behind ``--only``). A new ``cuda``
  test in a file no stage names, or a ``-k`` expression that no longer matches the test ids, fails here.
* The report turns each stage's JUnit XML into counts, and a stage whose XML is missing or cut short (pytest killed
  while writing it) is named, the other stages still reported.
"""

from __future__ import annotations

import functools
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "scripts" / "gpu" / "gpu_check.sh"


def gpu_check(*args: str, cwd: Path = REPO, python: str = sys.executable) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHON": python}
    return subprocess.run(["bash", str(SCRIPT), *args], capture_output=True, text=True, env=env, cwd=cwd,
                          timeout=300)


@pytest.mark.parametrize("args", [["--bogus"], ["--out"], ["--out="], ["--only"], ["--only="],
                                  ["--only", "fast,nope"], ["--out", "OUT", "--only", "compile"],
                                  ["--only", "two"]])
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
    for option in ("--out DIR", "--full", "--only", "--list", "PYTHON"):
        assert option in result.stdout, option
    assert "set -uo" not in result.stdout  # the comment block alone


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")
def test_without_cuda_it_stops_before_any_stage_with_exit_1(tmp_path: Path) -> None:
    result = gpu_check("--out", str(tmp_path / "out"))
    assert result.returncode == 1, result.stderr
    assert result.stdout.strip().splitlines()[-1] == "gpu_check: no CUDA device", result.stdout
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["gpu_check.log"]
    assert "stage" not in (tmp_path / "out" / "gpu_check.log").read_text()
    # A relative --out is where the caller is, not in the repository (the script runs from its root).
    before = written_by_default()
    for out in (["--out", "relative"], ["--out=relative_too"]):
        assert gpu_check(*out, cwd=tmp_path).returncode == 1
    assert (tmp_path / "relative" / "gpu_check.log").is_file() and (tmp_path / "relative_too" / "gpu_check.log").is_file()
    assert not (REPO / "relative").exists() and not (REPO / "relative_too").exists()
    assert written_by_default() == before


def _stage_selection(*args: str, python: str) -> dict[str, list[str]]:
    result = gpu_check("--list", *args, python=python)
    assert result.returncode == 0, result.stderr[-3000:]
    stages: dict[str, list[str]] = {}
    for line in result.stdout.splitlines():
        if re.match(r"^\w+ tests/\S+::\S+$", line):
            stage, test = line.split(" ")
            stages.setdefault(stage, []).append(test)
    return stages


def cuda_tests() -> set[str]:
    """Every ``cuda``-marked test of the suite, as pytest collects it (the files that can hold one: the GPU suite,
    and any test file that names the marker)."""
    files = sorted({str(p.relative_to(REPO)) for p in (REPO / "tests").rglob("test_*.py")
                    if p.parent.name == "gpu" or "mark.cuda" in p.read_text()})
    result = subprocess.run([sys.executable, "-m", "pytest", "-m", "cuda", "--collect-only", "-q",
                             "-p", "no:cacheprovider", "-o", "addopts=", *files],
                            capture_output=True, text=True, cwd=REPO, timeout=300)
    assert result.returncode == 0, result.stdout[-3000:]
    return {line for line in result.stdout.splitlines() if re.match(r"^tests/\S+::\S+$", line)}


PYTEST_STAGES = ["compiled", "dpo", "fast", "moe", "offload", "planner", "two_ranks", "world8"]
DEFAULT_PYTEST_STAGES = ["fast", "moe", "two_ranks"]  # with env, the default run's


# What the script runs as $PYTHON for --list: the interpreter, except that a pytest collection it has already run
# with the same arguments, folder and PYTHONPATH prints that collection's output and exit status again instead of
# collecting anew (a collection is a fresh interpreter importing the suite: seconds). The default run's stages and
# --only's whole stages are --full's own pytest commands: a stage given other arguments is collected afresh.
COLLECTING_ONCE = """#!/usr/bin/env bash
if [ "${1:-} ${2:-}" = "-m pytest" ] && [[ " $* " == *" --collect-only "* ]]; then
  key="$(printf '%s\\0' "$PWD" "${PYTHONPATH:-}" "$@" | sha256sum | cut -c1-40)"
  [ -f "$0.d/$key.status" ] || { "$REAL_PYTHON" "$@" > "$0.d/$key.out" 2>&1; echo $? > "$0.d/$key.status"; }
  cat "$0.d/$key.out"
  exit "$(cat "$0.d/$key.status")"
fi
exec "$REAL_PYTHON" "$@"
"""


@pytest.fixture
def collecting_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    python = tmp_path / "python"
    python.write_text(COLLECTING_ONCE)
    python.chmod(0o755)
    (tmp_path / "python.d").mkdir()
    monkeypatch.setenv("REAL_PYTHON", sys.executable)
    return str(python)


@pytest.mark.slow
def test_every_cuda_test_is_in_exactly_one_stage_and_the_default_run_is_the_short_stages(collecting_once) -> None:
    expected = cuda_tests()
    stage_selection = functools.partial(_stage_selection, python=collecting_once)
    full = stage_selection("--full")
    assert sorted(full) == PYTEST_STAGES
    listed = [test for tests in full.values() for test in tests]
    assert len(listed) == len(set(listed)), "a test in two stages"
    assert set(listed) == expected, (sorted(expected - set(listed)), sorted(set(listed) - expected))
    # The default run is the short stages, whole; the others run when --only names them.
    default = stage_selection()
    assert sorted(default) == DEFAULT_PYTEST_STAGES
    assert all(default[stage] == full[stage] for stage in default)
    # The planner stage is the compiled no-AC and per-op runs, packed by default, unpacked too with --full.
    assert sorted(t.rsplit("[", 1)[1] for t in full["planner"]) == [
        "packed-none-compiled]", "packed-per_op-compiled]", "unpacked-none-compiled]", "unpacked-per_op-compiled]"]
    only = stage_selection("--only", "planner,compiled")
    assert sorted(t.rsplit("[", 1)[1] for t in only["planner"]) == ["packed-none-compiled]", "packed-per_op-compiled]"]
    assert set(only["compiled"]) < set(full["compiled"])
    # --only names a stage's own tests alone.
    assert stage_selection("--only", "two_ranks,world8") == {k: full[k] for k in ("two_ranks", "world8")}


def test_the_default_run_fits_300_s_with_its_kill_margins() -> None:
    """The limits the script passes to ``timeout`` (each stage's own ``run_stage``/``pytest_stage`` call, --full's
    branch left out) of the default run's stages, plus each stage's 20 s kill margin: under 300 s, so that a rerun
    fits a 15-minute loan too; against its header's sums."""
    text = SCRIPT.read_text()
    body = re.sub(r'if \[ "\$FULL" -eq 1 \]; then\n(.*?)\nelse\n', "", text, flags=re.S)  # the default branches
    body = re.sub(r'if \[ "\$FULL" -eq 1 \]; then\n.*?\nfi\n', "", body, flags=re.S)
    limits = {m.group(1): int(m.group(2) or m.group(3)) for m in re.finditer(
        r"^\s*(?:run_stage|pytest_stage) (\w+) (?:\$\(\((\d+) \* scale\)\)|(\d+))", body, flags=re.M)}
    assert sorted(limits) == sorted(["env", "fast", "moe", "dpo", "two_ranks", "world8", "planner", "compiled",
                                     "llama8b", "bench"])
    default = re.search(r'^DEFAULT_STAGES=",([\w,]+),"', text, flags=re.M).group(1).split(",")
    assert sorted(default) == sorted(["env", *DEFAULT_PYTEST_STAGES])
    default_s = sum(limits[stage] for stage in default)
    assert f"add up to {default_s} s, {default_s + 20 * len(default)} s with" in text
    assert default_s + 20 * len(default) <= 300
    others = sum(v for k, v in limits.items() if k not in default)
    assert f"limits add up to {others} s" in text


# ---------------------------------------------------------------------------------------------------- the report

STAGE_TESTS = """
import pytest

def test_passes(record_property):
    record_property("planned_gib", 0.668)
    record_property("recompiles", 1)
    assert True

def test_fails():
    assert 1 == 2, "one is not two"

@pytest.mark.skip(reason="not here")
def test_skipped():
    pass
"""


def test_the_report_counts_each_stage_keeps_figures_and_names_missing_and_unreadable_xml(tmp_path: Path) -> None:
    (tmp_path / "test_stage.py").write_text(STAGE_TESTS)
    subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-o", "addopts=",
                    "--rootdir", str(tmp_path), "--junitxml", str(tmp_path / "gpu_fast.xml"),
                    str(tmp_path / "test_stage.py")], capture_output=True, text=True, cwd=tmp_path, timeout=120)
    whole = (tmp_path / "gpu_fast.xml").read_text()
    (tmp_path / "gpu_offload.xml").write_text(whole[: len(whole) // 2])  # killed while writing it
    (tmp_path / "gpu_bench.xml").write_text("")
    out = tmp_path / "report" / "gpu_tests.json"
    result = subprocess.run([sys.executable, str(REPO / "scripts" / "gpu" / "gpu_report.py"), "--out", str(out),
                             *(str(tmp_path / f"gpu_{stage}.xml") for stage in ("fast", "offload", "compiled", "bench"))],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0 and "Traceback" not in result.stderr, result.stderr
    report = json.loads(out.read_text())
    assert report["counts"] == {"passed": 1, "failed": 1, "error": 0, "skipped": 1}
    assert {t["test"].rsplit("::", 1)[1]: t["outcome"] for t in report["tests"]} == {
        "test_passes": "passed", "test_fails": "failed", "test_skipped": "skipped"}
    assert all(t["stage"] == "fast" for t in report["tests"])
    figures = {t["test"].rsplit("::", 1)[1]: t.get("figures") for t in report["tests"]}
    assert figures == {"test_passes": {"planned_gib": 0.668, "recompiles": 1}, "test_fails": None,
                       "test_skipped": None}
    assert "one is not two" in next(t["message"] for t in report["tests"] if t["outcome"] == "failed")
    assert report["missing_stages"] == ["gpu_compiled.xml"]
    assert sorted(report["unreadable_stages"]) == ["gpu_bench.xml", "gpu_offload.xml"]
    assert "unreadable XML from gpu_offload.xml, gpu_bench.xml" in result.stdout
