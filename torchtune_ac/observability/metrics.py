"""``metrics.jsonl``: one JSON object per optimizer step, read by external tools.

Fields (a contract): ``step``, ``epoch``, ``loss``, ``lr``, ``grad_norm``, ``tokens_per_second``,
``peak_memory_gib``, plus ``tokens`` (token positions processed in this step on all ranks, padding included),
``target_tokens`` (positions that count in the loss), ``step_time_s`` and ``target_tokens_per_second`` (the rate
of target tokens: unlike ``tokens_per_second`` it does not count padding, so packed and unpacked runs compare).
"""

from __future__ import annotations

import json
import os
import resource
import sys
from pathlib import Path
from typing import Any, Mapping

import torch

METRICS_FILE = "metrics.jsonl"


def peak_memory_gib(device: torch.device) -> float:
    """CUDA max allocated on ``device``, or this process's peak resident set size on CPU, in GiB."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    peak_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    # Linux reports KiB, macOS bytes.
    return peak_kib / 2**30 if sys.platform == "darwin" else peak_kib / 2**20


class MetricsWriter:
    """Appends one line per step to ``output_dir/metrics.jsonl`` (flushed, so a killed run keeps its lines)."""

    def __init__(self, output_dir: str | os.PathLike, *, resume_after_step: int | None = None) -> None:
        """Open the metrics file.

        Args:
            output_dir: run directory.
            resume_after_step: when resuming from a checkpoint taken after this step, lines for later steps
                (logged by the interrupted run after its last checkpoint) are dropped first, so every step
                appears once; so is a last line cut short by a kill mid-write (it has no newline).
        """
        self.path = Path(output_dir) / METRICS_FILE
        if resume_after_step is not None and self.path.exists():
            kept = [
                line
                for line in self.path.read_text().splitlines(keepends=True)
                if line.endswith("\n") and json.loads(line)["step"] <= resume_after_step
            ]
            tmp = self.path.with_suffix(".jsonl.tmp")
            tmp.write_text("".join(kept))
            os.replace(tmp, self.path)
        self._file = self.path.open("a", encoding="utf-8")

    def write(self, record: Mapping[str, Any]) -> None:
        self._file.write(json.dumps(dict(record)) + "\n")
        self._file.flush()

    def close(self) -> None:
        self._file.close()


def read_metrics(output_dir: str | os.PathLike) -> list[dict[str, Any]]:
    """All records of ``output_dir/metrics.jsonl`` (for tests and tools)."""
    path = Path(output_dir) / METRICS_FILE
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
