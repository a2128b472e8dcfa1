"""metrics.jsonl: one line per step, and a resumed run rewrites the tail the interrupted run left."""

import json

import pytest
import torch

from torchtune_ac.observability.metrics import METRICS_FILE, MemoryPeaks, MetricsWriter, peak_memory_gib, read_metrics

GiB = 2**30


def write_steps(out, steps, **kwargs):
    writer = MetricsWriter(out, **kwargs)
    for step in steps:
        writer.write({"step": step, "loss": 1.0 / step})
    writer.close()


def test_resume_drops_steps_after_the_checkpoint_and_a_line_cut_by_a_kill(tmp_path):
    write_steps(tmp_path, [1, 2, 3, 4])
    with (tmp_path / METRICS_FILE).open("a") as f:
        f.write('{"step": 5, "lo')  # killed mid-write: no newline, not JSON
    write_steps(tmp_path, [3, 4, 5], resume_after_step=2)
    assert [r["step"] for r in read_metrics(tmp_path)] == [1, 2, 3, 4, 5]
    assert all(line.endswith("}") for line in (tmp_path / METRICS_FILE).read_text().splitlines())


def test_fresh_writer_appends_flushed_lines(tmp_path):
    writer = MetricsWriter(tmp_path)
    writer.write({"step": 1, "loss": 2.5})
    # Flushed per line: a reader (or a kill) sees it before close.
    assert json.loads((tmp_path / METRICS_FILE).read_text()) == {"step": 1, "loss": 2.5}
    writer.close()


class FakeCudaMemory:
    """``torch.cuda``'s peak counters, stood in for: ``allocate`` raises the current use as tensors would."""

    def __init__(self):
        self.allocated = self.reserved = self.peak_allocated = self.peak_reserved = 0
        self.resets = 0

    def allocate(self, allocated, reserved):
        self.allocated, self.reserved = allocated, reserved
        self.peak_allocated = max(self.peak_allocated, allocated)
        self.peak_reserved = max(self.peak_reserved, reserved)

    def install(self, monkeypatch):
        monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda device=None: self.peak_allocated)
        monkeypatch.setattr(torch.cuda, "max_memory_reserved", lambda device=None: self.peak_reserved)
        monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", self.reset)

    def reset(self, device=None):
        self.peak_allocated, self.peak_reserved = self.allocated, self.reserved
        self.resets += 1


def test_cuda_peaks_are_those_since_the_line_before_with_the_reserved_peak(monkeypatch):
    cuda = FakeCudaMemory()
    cuda.install(monkeypatch)
    peaks = MemoryPeaks(torch.device("cuda", 0))
    lines = []
    for allocated, reserved, after in [(6, 8, 1), (3, 5, 1), (4, 8, 2)]:  # GiB at the step's peak, then after it
        cuda.allocate(allocated * GiB, reserved * GiB)
        cuda.allocate(after * GiB, reserved * GiB)
        lines.append(peaks.since_last())
    assert lines == [
        {"peak_memory_gib": 6, "peak_memory_reserved_gib": 8},
        {"peak_memory_gib": 3, "peak_memory_reserved_gib": 8},  # step 2 held less than step 1
        {"peak_memory_gib": 4, "peak_memory_reserved_gib": 8},
    ]
    assert cuda.resets == 3
    cuda.allocate(5 * GiB, 8 * GiB)
    assert peaks.run_peak_gib() == 6


def test_cpu_peak_is_the_resident_peak_without_a_reserved_field(monkeypatch):
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda device=None: pytest.fail("reset on a CPU run"))
    line = MemoryPeaks(torch.device("cpu")).since_last()
    assert set(line) == {"peak_memory_gib"}
    assert line["peak_memory_gib"] == peak_memory_gib(torch.device("cpu")) > 0
