"""Training: the step (``step.py``: who steps the parameters, the objective each micro-batch's loss comes from),
activation checkpointing (``activation_checkpointing.py``, and its config keys in ``ac_config.py``), evaluation
and the LR schedules.

The names below are the package's public ones: the LR schedules configs name as components
(``_component_: torchtune_ac.training.cosine_schedule_with_warmup``) and ``setup_activation_checkpointing``.
"""

from torchtune_ac.training.ac_config import ACConfig, ACConfigError, resolve_ac_plan, setup_activation_checkpointing
from torchtune_ac.training.activation_checkpointing import ACMode, ACPlan, apply_ac_plan
from torchtune_ac.training.lr_schedulers import constant_schedule, cosine_schedule_with_warmup

__all__ = [
    "ACConfig",
    "ACConfigError",
    "ACMode",
    "ACPlan",
    "apply_ac_plan",
    "constant_schedule",
    "cosine_schedule_with_warmup",
    "resolve_ac_plan",
    "setup_activation_checkpointing",
]
