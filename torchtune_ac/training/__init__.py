"""Training building blocks: activation checkpointing, FSDP2 sharding, the train step, checkpoints, metrics and
experiment trackers."""

from torchtune_ac.training.activation_checkpointing import (
    ACConfig,
    ACMode,
    ACPlan,
    apply_ac_plan,
    resolve_ac_plan,
    setup_activation_checkpointing,
)
from torchtune_ac.training.lr_schedulers import constant_schedule, cosine_schedule_with_warmup
from torchtune_ac.training.metric_logging import TensorBoardLogger, WandBLogger

__all__ = [
    "ACConfig",
    "ACMode",
    "ACPlan",
    "TensorBoardLogger",
    "WandBLogger",
    "apply_ac_plan",
    "constant_schedule",
    "cosine_schedule_with_warmup",
    "resolve_ac_plan",
    "setup_activation_checkpointing",
]
