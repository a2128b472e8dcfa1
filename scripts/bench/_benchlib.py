"""What the benchmark scripts share: charts drawn without a display, and one way to write a report; for the
side-by-side benchmarks, each side run in a fresh worker process and its runs summarised (medians).

Each ``scripts/bench/bench_*.py`` measures something different; how it ends is the same: print the table, write the JSON
into ``bench_results/``, draw the PNG, and say where both went.
"""

from __future__ import annotations

import json
import os
import resource
import subprocess
import sys
from pathlib import Path
from typing import Any, Callable, Optional, Sequence


def leave_spawned_rank() -> None:
    """End a spawned rank that finished its work (process group already destroyed) with status 0.

    Skips the interpreter's teardown, where a race in gloo's C++ destructors can abort an already finished
    rank with SIGABRT, failing ``mp.spawn`` after the measurement was written (the recipe's workers leave the
    same way, see ``torchtune_ac.cli._leave_worker``).
    """
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def pyplot() -> Any:
    """Return ``matplotlib.pyplot`` on the Agg backend, which needs no display.

    Imported on first use, so that ``--help`` and the measurements do not pay for matplotlib.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save_figure(fig: Any, path: Path, dpi: int = 120) -> None:
    """Lay out ``fig``, write it to ``path`` (creating its folder) and free it."""
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=dpi)
    pyplot().close(fig)


def write_report(report: dict, table: str, out_json: Path,
                 plot: Optional[Callable[[dict, Path], None]] = None, out_png: Optional[Path] = None) -> None:
    """Print ``table``, write ``report`` as JSON to ``out_json`` and, given ``plot``, draw it to ``out_png``.

    Raises:
        ValueError: ``plot`` is given without ``out_png``.
    """
    if plot is not None and out_png is None:
        raise ValueError("write_report: a plot needs out_png")
    print(table)
    out_json.parent.mkdir(parents=True, exist_ok=True)
    out_json.write_text(json.dumps(report, indent=2) + "\n")
    written = [out_json]
    if plot is not None:
        plot(report, out_png)
        written.append(out_png)
    print("wrote " + " and ".join(str(path) for path in written))


def resident_gib() -> float:
    """The process's resident set now, in GiB (Linux)."""
    pages = int(Path("/proc/self/statm").read_text().split()[1])
    return pages * os.sysconf("SC_PAGE_SIZE") / 2**30


def reset_peak() -> None:
    """Hand the heap's free pages back to the system (glibc's ``malloc_trim``) and start ``peak_gib`` again from the
    resident set now (Linux: writing 5 to ``/proc/self/clear_refs`` resets ``VmHWM``), so that a peak measured
    over the steps leaves out what the set-up freed (a model built dense, then quantised)."""
    import ctypes

    ctypes.CDLL("libc.so.6").malloc_trim(0)
    Path("/proc/self/clear_refs").write_text("5")


def peak_gib() -> float:
    """The process's peak resident set since it started or since ``reset_peak``, in GiB (Linux: ``VmHWM``)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024 / 2**30  # kB
    raise RuntimeError("/proc/self/status has no VmHWM")


def process_peak_gib() -> float:
    """The process's peak resident set over its whole life, set-up included, in GiB (``ru_maxrss``, KiB on Linux)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 2**30


def median(values: Sequence[float]) -> float:
    """The middle value (the upper one of an even count)."""
    ordered = sorted(values)
    return ordered[len(ordered) // 2]


def run_side(script: Path, side: str, settings: dict, threads: int) -> dict:
    """Run ``script --side SIDE --settings JSON`` in a fresh process on ``threads`` threads (its peak resident set
    its own) and return the JSON its last line of output holds.

    Raises:
        SystemExit: the worker failed (the end of its stderr is written first).
    """
    repo = Path(script).resolve().parents[2]
    env = {**os.environ, "PYTHONPATH": f"{repo}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
           "OMP_NUM_THREADS": str(threads), "OMP_WAIT_POLICY": "PASSIVE"}
    done = subprocess.run([sys.executable, str(script), "--side", side, "--settings", json.dumps(settings)],
                          env=env, capture_output=True, text=True)
    if done.returncode != 0:
        sys.stderr.write(done.stderr[-4000:])
        raise SystemExit(f"{Path(script).stem}: the {side} side failed (exit {done.returncode})")
    return json.loads(done.stdout.strip().splitlines()[-1])


def summarize_sides(runs: list[dict], sides: Sequence[str], warmup: int, keep: Sequence[str] = ()) -> dict:
    """Each side's median step (its runs' steps pooled, after ``warmup``) and memory over its runs; ``keep`` names
    values copied from the side's first run.

    Each run is ``{"side", "step_seconds", "resident_before_gib", "peak_gib", *keep}``.

    Raises:
        RuntimeError: a side has no step left after the warm-up.
    """
    summary = {}
    for side in sides:
        mine = [r for r in runs if r["side"] == side]
        timed = [s for r in mine for s in r["step_seconds"][warmup:]]
        if not timed:
            raise RuntimeError(f"{side}: no step left after {warmup} warm-up step(s): more --steps")
        summary[side] = {
            "step_s": median(timed),
            "resident_before_gib": median([r["resident_before_gib"] for r in mine]),
            "peak_gib": median([r["peak_gib"] for r in mine]),
            "step_added_gib": median([r["peak_gib"] - r["resident_before_gib"] for r in mine]),
            **{key: mine[0][key] for key in keep},
        }
    return summary
