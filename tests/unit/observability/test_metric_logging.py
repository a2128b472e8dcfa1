"""TensorBoard and W&B trackers: read back what they wrote (event files; W&B offline runs), resume without
drawing a step twice, and a missing package is one line naming the extra to install."""

from __future__ import annotations

import importlib.util

import pytest

from torchtune_ac.config import FullFinetuneConfig, validate_config
from torchtune_ac.errors import UserError
from torchtune_ac.observability.metric_logging import WANDB_RUN_ID_FILE, open_run_log, plain_config
from torchtune_ac.observability.metrics import read_metrics
from torchtune_ac.observability.metric_logging import TensorBoardLogger, WandBLogger

pytest.importorskip("tensorboard")
pytest.importorskip("wandb")

from numerics import FLOAT32_STORAGE  # noqa: E402
from tracker_readers import read_tensorboard, read_wandb_offline_runs  # noqa: E402

CONFIG = {"output_dir": "/tmp/out", "batch_size": 2, "model": {"_component_": "torchtune_ac.models.llama_tiny"}}


def record(step: int, scale: float = 1.0) -> dict:
    return {"step": step, "epoch": 0, "loss": scale / step, "lr": 1e-3 * step, "grad_norm": 0.5,
            "tokens_per_second": 100.0 * step, "peak_memory_gib": 0.25, "tokens": 64, "target_tokens": 20,
            "step_time_s": 0.5, "target_tokens_per_second": 40.0}


def log_steps(tmp_path, tracker, steps, *, resume_after_step=None, scale=1.0):
    run = open_run_log(tmp_path, tracker, config=CONFIG, resume_after_step=resume_after_step)
    for step in steps:
        run.write(record(step, scale))
    run.close(succeeded=True)


def test_tensorboard_has_every_metrics_field_and_the_config(tmp_path):
    log_steps(tmp_path, TensorBoardLogger(), [1, 2, 3])
    scalars, texts = read_tensorboard(tmp_path / "tensorboard")
    fields = set(record(1)) - {"step"}
    assert set(scalars) == fields
    for row in read_metrics(tmp_path):
        for name in fields:
            assert scalars[name][row["step"]] == pytest.approx(row[name], rel=FLOAT32_STORAGE)  # stored as float32
    assert texts and '"batch_size": 2' in texts[0]


def test_tensorboard_resume_purges_the_steps_after_the_checkpoint(tmp_path):
    log_steps(tmp_path, TensorBoardLogger(), [1, 2, 3, 4])  # killed after step 4, checkpoint at step 2
    log_steps(tmp_path, TensorBoardLogger(), [3, 4, 5], resume_after_step=2, scale=10.0)
    scalars, _ = read_tensorboard(tmp_path / "tensorboard")
    assert scalars["loss"] == pytest.approx({1: 1.0, 2: 0.5, 3: 10 / 3, 4: 2.5, 5: 2.0}, rel=FLOAT32_STORAGE)


def test_tensorboard_log_dir(tmp_path):
    log_steps(tmp_path, TensorBoardLogger(log_dir=str(tmp_path / "tb")), [1])
    assert read_tensorboard(tmp_path / "tb")[0]["loss"] == {1: 1.0}


def test_wandb_offline_run_holds_the_records_and_the_config(tmp_path):
    log_steps(tmp_path, WandBLogger(project="p", mode="offline", tags=["a"]), [1, 2, 3])
    (run,) = read_wandb_offline_runs(tmp_path)
    assert run["id"] == (tmp_path / WANDB_RUN_ID_FILE).read_text().strip()
    assert run["config"]["batch_size"] == 2 and run["config"]["model"] == CONFIG["model"]
    expected = {r["step"]: {k: v for k, v in r.items() if k != "step"} for r in read_metrics(tmp_path)}
    assert run["history"] == expected


def test_wandb_resume_continues_the_same_run(tmp_path):
    log_steps(tmp_path, WandBLogger(mode="offline"), [1, 2])
    log_steps(tmp_path, WandBLogger(mode="offline"), [3], resume_after_step=2)
    first, second = read_wandb_offline_runs(tmp_path)
    assert first["id"] == second["id"]
    assert sorted(first["history"]) == [1, 2] and sorted(second["history"]) == [3]


def test_wandb_mode_is_checked():
    with pytest.raises(UserError, match="metric_logger.mode='offlne': must be one of online, offline, disabled"):
        WandBLogger(mode="offlne")


@pytest.mark.parametrize(
    "logger, package, extra",
    [(TensorBoardLogger, "tensorboard", "tensorboard"), (WandBLogger, "wandb", "wandb")],
)
def test_missing_package_names_the_extra(monkeypatch, logger, package, extra):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == package else real(name, *a))
    with pytest.raises(UserError) as info:
        logger().check_available()
    assert str(info.value) == (
        f"metric_logger: {logger.__name__} needs the {package} package: pip install 'torchtune_ac[{extra}]'"
    )


def test_plain_config_is_what_the_yaml_said():
    cfg = validate_config(
        {
            "output_dir": "/tmp/out",
            "model": {"_component_": "torchtune_ac.models.llama_tiny"},
            "tokenizer": {"_component_": "torchtune_ac.data.load_tokenizer", "path": "/tmp/tok"},
            "dataset": {"_component_": "torchtune_ac.data.instruct_dataset", "source": "d.jsonl"},
            "optimizer": {"_component_": "torch.optim.AdamW", "lr": 1e-3},
            "dtype": "BF16",
            "metric_logger": {"_component_": "torchtune_ac.training.metric_logging.WandBLogger", "project": "x"},
        },
        FullFinetuneConfig,
        source="c.yaml",
    )
    plain = plain_config(cfg)
    assert plain["dtype"] == "bf16" and plain["fsdp"]["reduce_dtype"] is None
    assert plain["optimizer"] == {"_component_": "torch.optim.AdamW", "lr": 1e-3}
    assert plain["metric_logger"] == {"_component_": "torchtune_ac.training.metric_logging.WandBLogger", "project": "x"}
