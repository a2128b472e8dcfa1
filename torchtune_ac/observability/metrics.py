"""``metrics.jsonl``: one JSON object per optimizer step, read by external tools.

Fields (a contract): ``step``, ``epoch``, ``loss``, ``lr``, ``grad_norm``, ``tokens_per_second``,
``peak_memory_gib``, plus ``tokens`` (token positions processed in this step on all ranks, padding included),
``target_tokens`` (positions that count in the loss), ``step_time_s`` and ``target_tokens_per_second`` (the rate
of target tokens: unlike ``tokens_per_second`` it does not count padding, so packed and unpacked runs compare),
and on CUDA ``peak_memory_reserved_gib`` (``MemoryPeaks``).
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
    """CUDA max allocated on ``device`` since its peaks were last reset, or this process's peak resident set size
    on CPU, in GiB."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    peak_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    # Linux reports KiB, macOS bytes.
    return peak_kib / 2**30 if sys.platform == "darwin" else peak_kib / 2**20


class MemoryPeaks:
    """The memory peaks of each logged step, since the one logged before, and of the whole run.

    On CUDA two peaks, both since the previous ``since_last``, whose CUDA peaks it then resets
    (``torch.cuda.reset_peak_memory_stats``): ``peak_memory_gib``, the most the tensors held
    (``max_memory_allocated``), and ``peak_memory_reserved_gib``, the most the caching allocator held
    (``max_memory_reserved``: the tensors, the blocks cached between them and their fragmentation; what the device
    gave this process besides its context and the communicators' buffers). On a CPU, ``peak_memory_gib`` is the
    process's peak resident set so far, which cannot be reset.
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._run_peak_gib = 0.0

    def since_last(self) -> dict[str, float]:
        """The fields of one ``metrics.jsonl`` line, then the CUDA peaks reset."""
        fields = {"peak_memory_gib": peak_memory_gib(self.device)}
        if self.device.type == "cuda":
            fields["peak_memory_reserved_gib"] = torch.cuda.max_memory_reserved(self.device) / 2**30
            torch.cuda.reset_peak_memory_stats(self.device)
        self._run_peak_gib = max(self._run_peak_gib, fields["peak_memory_gib"])
        return fields

    def run_peak_gib(self) -> float:
        """``peak_memory_gib`` over the whole run so far, the steps since the last ``since_last`` included."""
        return max(self._run_peak_gib, peak_memory_gib(self.device))


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
