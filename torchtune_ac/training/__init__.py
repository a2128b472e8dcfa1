"""Training: the model assembled in the one working order (``model_setup.py``), the step (``step.py``), the
objective (``objective.py``) and the LR schedules.

The names below are what configs and scripts import from here (``_component_:
torchtune_ac.training.cosine_schedule_with_warmup``, ``setup_activation_checkpointing``); they are defined in
the packages that own them (``memory``, ``observability``).
"""

from torchtune_ac.memory.activation_checkpointing import (
    ACConfig,
    ACMode,
    ACPlan,
    apply_ac_plan,
    resolve_ac_plan,
    setup_activation_checkpointing,
)
from torchtune_ac.observability.metric_logging import TensorBoardLogger, WandBLogger
from torchtune_ac.training.lr_schedulers import constant_schedule, cosine_schedule_with_warmup

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
