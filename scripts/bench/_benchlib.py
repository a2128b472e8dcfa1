"""What the benchmark scripts share: charts drawn without a display, and one way to write a report.

Each ``scripts/bench/bench_*.py`` measures something different; how it ends is the same: print the table, write the JSON
into ``bench_results/``, draw the PNG, and say where both went.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any, Callable, Optional


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
