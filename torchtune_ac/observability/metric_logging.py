"""Experiment trackers behind the ``metric_logger`` config key: TensorBoard and Weights & Biases.

``output_dir/metrics.jsonl`` is always written (``metrics.py``); a tracker receives the same records. Each is
a ``_component_`` (``metric_logger: {_component_: torchtune_ac.training.metric_logging.WandBLogger, project:
x}``) whose constructor only stores and checks its settings, so ``tune validate`` can build it; the recipe
calls ``start`` on rank 0 only, once the output directory exists. The packages are optional extras:
``pip install 'torchtune_ac[tensorboard]'`` or ``'torchtune_ac[wandb]'``; :meth:`check_available` says which
one is missing before training starts.

Resume: TensorBoard purges the events of steps after the checkpoint (``purge_step``), so a resumed run does
not draw two lines; W&B continues the same run (its id is kept in ``output_dir``), and W&B itself ignores
values for steps it already has.
"""

from __future__ import annotations

import dataclasses
import enum
import importlib.util
import json
import os
import uuid
from pathlib import Path
from typing import Any, Mapping, Optional, Protocol, Sequence

from torchtune_ac.component_marker import config_component
from torchtune_ac.errors import UnavailableError, UserError
from torchtune_ac.observability.metrics import MetricsWriter

TENSORBOARD_DIR = "tensorboard"
WANDB_RUN_ID_FILE = "wandb_run_id"
WANDB_MODES = ("online", "offline", "disabled")


class MetricLogger(Protocol):
    """What the recipe needs from a tracker (rank 0 only)."""

    def check_available(self) -> None:
        """Raise ``UserError`` naming the extra to install when the tracker's package is missing."""

    def start(self, output_dir: Path, *, config: Mapping[str, Any], resume_after_step: Optional[int]) -> None:
        """Open the run; ``config`` is the resolved config as plain values, ``resume_after_step`` the step of the
        checkpoint a resumed run continues from (None for a fresh run)."""

    def log(self, record: Mapping[str, Any]) -> None:
        """Log one ``metrics.jsonl`` record (``step`` is the x axis, every other number a series)."""

    def close(self, *, succeeded: bool) -> None:
        """Flush and close."""


def _require(package: str, logger: str, extra: str) -> None:
    if importlib.util.find_spec(package) is None:
        raise UnavailableError(
            f"metric_logger: {logger} needs the {package} package: pip install 'torchtune_ac[{extra}]'"
        )


@config_component
class TensorBoardLogger:
    """TensorBoard event files, one scalar series per ``metrics.jsonl`` field, plus the config as text."""

    def __init__(self, log_dir: Optional[str] = None) -> None:
        """
        Args:
            log_dir: folder of the event files; default ``<output_dir>/tensorboard``.
        """
        self.log_dir = log_dir
        self._writer: Any = None

    def check_available(self) -> None:
        _require("tensorboard", "TensorBoardLogger", "tensorboard")

    def start(self, output_dir: Path, *, config: Mapping[str, Any], resume_after_step: Optional[int]) -> None:
        from torch.utils.tensorboard import SummaryWriter

        log_dir = Path(self.log_dir).expanduser() if self.log_dir else Path(output_dir) / TENSORBOARD_DIR
        # purge_step: TensorBoard hides the earlier events of steps from here on (logged by the interrupted
        # run after its last checkpoint), so each step is drawn once.
        purge_step = None if resume_after_step is None else resume_after_step + 1
        self._writer = SummaryWriter(log_dir=str(log_dir), purge_step=purge_step)
        if resume_after_step is None:
            self._writer.add_text("config", "```\n" + json.dumps(config, indent=2) + "\n```", global_step=0)

    def log(self, record: Mapping[str, Any]) -> None:
        step = record["step"]
        for name, value in record.items():
            if name != "step" and isinstance(value, (int, float)) and not isinstance(value, bool):
                self._writer.add_scalar(name, value, global_step=step)
        self._writer.flush()

    def close(self, *, succeeded: bool) -> None:
        if self._writer is not None:
            self._writer.close()


@config_component
class WandBLogger:
    """A Weights & Biases run: the config once, then each ``metrics.jsonl`` record at its ``step``."""

    def __init__(
        self,
        project: str = "torchtune_ac",
        entity: Optional[str] = None,
        name: Optional[str] = None,
        group: Optional[str] = None,
        mode: Optional[str] = None,
        tags: Optional[list[str]] = None,
        notes: Optional[str] = None,
        log_dir: Optional[str] = None,
    ) -> None:
        """
        Args:
            project, entity, name, group, tags, notes: as for ``wandb.init``.
            mode: ``online``, ``offline`` (files only; ``wandb sync`` uploads them later) or ``disabled``;
                default: W&B's own choice (``WANDB_MODE``, else online).
            log_dir: folder under which W&B writes its ``wandb/`` files; default ``output_dir``.

        Raises:
            UserError: an unknown ``mode``.
        """
        if mode is not None and mode not in WANDB_MODES:
            raise UserError(f"metric_logger.mode={mode!r}: must be one of {', '.join(WANDB_MODES)} or null")
        self.settings = {"project": project, "entity": entity, "name": name, "group": group, "mode": mode,
                         "tags": list(tags) if tags is not None else None, "notes": notes}
        self.log_dir = log_dir
        self._run: Any = None

    def check_available(self) -> None:
        _require("wandb", "WandBLogger", "wandb")

    def start(self, output_dir: Path, *, config: Mapping[str, Any], resume_after_step: Optional[int]) -> None:
        import wandb

        id_file = Path(output_dir) / WANDB_RUN_ID_FILE
        if resume_after_step is not None and id_file.is_file():
            run_id = id_file.read_text().strip()
        else:
            run_id = uuid.uuid4().hex[:8]  # W&B run ids: short, lower-case alphanumeric
            id_file.write_text(run_id + "\n")
        log_dir = Path(self.log_dir).expanduser() if self.log_dir else Path(output_dir)
        log_dir.mkdir(parents=True, exist_ok=True)
        self._run = wandb.init(
            **{k: v for k, v in self.settings.items() if v is not None},
            dir=str(log_dir),
            id=run_id,
            resume="allow",
            config=dict(config),
            # Leave stdout/stderr alone: the recipe decides between a progress bar and plain lines by whether
            # stderr is a terminal, and W&B's capture would wrap it.
            settings=wandb.Settings(console="off"),
        )

    def log(self, record: Mapping[str, Any]) -> None:
        self._run.log({k: v for k, v in record.items() if k != "step"}, step=record["step"])

    def close(self, *, succeeded: bool) -> None:
        if self._run is not None:
            self._run.finish(exit_code=0 if succeeded else 1)


class RunLog:
    """Where rank 0's per-step records go: ``metrics.jsonl`` always, and the tracker when one is configured."""

    def __init__(self, metrics: MetricsWriter, trackers: Sequence[MetricLogger] = ()) -> None:
        self.metrics = metrics
        self.trackers = list(trackers)

    def write(self, record: Mapping[str, Any]) -> None:
        self.metrics.write(record)
        # Trackers take scalars: a list (the tokens each expert received) is for metrics.jsonl only.
        scalars = {key: value for key, value in record.items() if not isinstance(value, list)}
        for tracker in self.trackers:
            tracker.log(scalars)

    def close(self, *, succeeded: bool = True) -> None:
        self.metrics.close()
        for tracker in self.trackers:
            tracker.close(succeeded=succeeded)


def open_run_log(
    output_dir: str | os.PathLike,
    tracker: Optional[MetricLogger],
    *,
    config: Any,
    resume_after_step: Optional[int],
) -> RunLog:
    """Open ``metrics.jsonl`` and start ``tracker`` (rank 0 only).

    Args:
        output_dir: the run's directory (already created).
        tracker: the instantiated ``metric_logger``, or None.
        config: the validated config (a dataclass); trackers receive it as plain values.
        resume_after_step: see :class:`MetricsWriter`.
    """
    metrics = MetricsWriter(output_dir, resume_after_step=resume_after_step)
    if tracker is None:
        return RunLog(metrics)
    tracker.start(Path(output_dir), config=plain_config(config), resume_after_step=resume_after_step)
    return RunLog(metrics, [tracker])


def plain_config(value: Any) -> Any:
    """A validated config as JSON-ready values, keyed as in YAML: components as their YAML nodes (anything with
    ``as_config()``), enums as their values, groups marked ``flatten`` at their parent's level."""
    if callable(getattr(value, "as_config", None)):
        return value.as_config()
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        plain: dict[str, Any] = {}
        for f in dataclasses.fields(value):
            item = plain_config(getattr(value, f.name))
            if f.metadata.get("flatten"):
                plain.update(item)
            else:
                plain[f.name] = item
        return plain
    if isinstance(value, enum.Enum):
        return value.value
    if isinstance(value, Mapping):
        return {str(k): plain_config(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [plain_config(v) for v in value]
    return value
