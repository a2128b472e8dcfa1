"""The real ``tune run`` with an experiment tracker, and its progress output with and without a terminal."""

from __future__ import annotations

import fcntl
import importlib.util
import os
import pty
import re
import struct
import subprocess
import termios
import threading
from pathlib import Path

import pytest
from finetune_runs import (
    check_success,
    run_tune_in_process,
    run_tune_subprocess,
    subprocess_env,
    tune_command,
    tune_run_argv,
)
from numerics import FLOAT32_STORAGE

from torchtune_ac.cli import main
from torchtune_ac.observability.metrics import read_metrics

pytest.importorskip("tensorboard")
pytest.importorskip("wandb")

from tracker_readers import read_tensorboard, read_wandb_offline_runs  # noqa: E402

LOGGERS = "torchtune_ac.observability.metric_logging"
TENSORBOARD = f"metric_logger={{_component_:{LOGGERS}.TensorBoardLogger}}"
WANDB_OFFLINE = f"metric_logger={{_component_:{LOGGERS}.WandBLogger,project:tests,mode:offline}}"
PLAIN_LINE = re.compile(
    r"^step (\d+)/5 \| loss \d+\.\d{4} \| lr \d\.\d\de[-+]\d\d \| tokens/s [\d,]+ \| target tokens/s [\d,]+ \| "
    r"elapsed \d+:\d\d:\d\d \| eta \d+:\d\d:\d\d$"
)


def test_log_file_gets_plain_lines_and_tensorboard_the_metrics(tmp_path: Path) -> None:
    """stderr captured (a pipe, as in a SLURM log): no carriage returns, a line every log_every_n_steps steps
    and at the last one, and metrics.jsonl likewise; TensorBoard holds exactly what metrics.jsonl holds."""
    out = tmp_path / "run"
    result = run_tune_subprocess(tune_run_argv(out, "log_every_n_steps=2", TENSORBOARD))
    check_success(result)
    assert "\r" not in result.stderr
    steps = [int(m.group(1)) for line in result.stderr.splitlines() if (m := PLAIN_LINE.match(line))]
    assert steps == [2, 4, 5], result.stderr

    records = read_metrics(out)
    assert [r["step"] for r in records] == [2, 4, 5]  # the last step too, though 2 does not divide it
    scalars, texts = read_tensorboard(out / "tensorboard")
    assert set(scalars) == set(records[0]) - {"step"}
    for record in records:
        for name, series in scalars.items():
            assert series[record["step"]] == pytest.approx(record[name], rel=FLOAT32_STORAGE)  # stored as float32
    assert f"{LOGGERS}.TensorBoardLogger" in texts[0] and str(out) in texts[0]


def test_terminal_gets_a_progress_bar(tmp_path: Path) -> None:
    """stderr a terminal (a pseudo-terminal here): tqdm's bar, which redraws with carriage returns, and no plain
    lines."""
    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 40, 160, 0, 0))  # 160 columns for the bar
    chunks: list[bytes] = []

    def drain() -> None:
        while True:
            try:
                data = os.read(master, 65536)
            except OSError:  # EIO: the child closed the terminal
                return
            if not data:
                return
            chunks.append(data)

    reader = threading.Thread(target=drain, daemon=True)
    reader.start()
    process = subprocess.run(tune_command(tune_run_argv(tmp_path / "run")), stdout=subprocess.DEVNULL, stderr=slave,
                             env=subprocess_env(), timeout=300, check=False)
    os.close(slave)
    reader.join(timeout=30)
    os.close(master)
    output = b"".join(chunks).decode(errors="replace")
    assert process.returncode == 0, output[-3000:]
    # The terminal turns each "\n" into "\r\n"; tqdm's redraws are the carriage returns not before a newline.
    redraws = re.findall(r"\r(?!\n)[^\r\n]*", output)
    assert redraws and "train: 100%" in redraws[-1] and "tgt_s=" in redraws[-1], output[-3000:]
    assert not any(PLAIN_LINE.match(line.strip()) for line in output.splitlines())


def test_wandb_offline_run_holds_every_step(tmp_path: Path) -> None:
    out = tmp_path / "run"
    check_success(run_tune_in_process(tune_run_argv(out, WANDB_OFFLINE)))
    (run,) = read_wandb_offline_runs(out)
    records = read_metrics(out)
    assert run["history"] == {r["step"]: {k: v for k, v in r.items() if k != "step"} for r in records}
    assert run["config"]["output_dir"] == str(out)
    assert run["config"]["metric_logger"] == {"_component_": f"{LOGGERS}.WandBLogger", "project": "tests",
                                             "mode": "offline"}


def test_missing_tracker_package_stops_run_and_warns_in_validate(tmp_path: Path, monkeypatch, capsys) -> None:
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else real(name, *a))
    out = tmp_path / "run"
    message = "metric_logger: WandBLogger needs the wandb package: pip install 'torchtune_ac[wandb]'"
    assert main(tune_run_argv(out, WANDB_OFFLINE)) == 2
    assert capsys.readouterr().err == f"tune: error: {message}\n"
    assert not out.exists()
    assert main(["validate", "--config", "tiny/full", WANDB_OFFLINE]) == 0
    assert re.search(rf"^  warning +{re.escape(message)}$", capsys.readouterr().out, re.MULTILINE)
