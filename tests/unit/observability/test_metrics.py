"""metrics.jsonl: one line per step, and a resumed run rewrites the tail the interrupted run left."""

import json

from torchtune_ac.observability.metrics import METRICS_FILE, MetricsWriter, read_metrics


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
