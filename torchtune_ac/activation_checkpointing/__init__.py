"""Activation checkpointing (AC), the product's centrepiece, in one package: its config keys, their validation and
the plan they resolve to (``config.py``: ``ACConfig``, ``resolve_ac_plan``, ``setup_activation_checkpointing``),
and the plan's value, its per-op policy and the mechanism that applies it to a model (``mechanism.py``: ``ACPlan``,
``apply_ac_plan``). ``ac_mode: auto``'s choice is the memory planner's (``memory/``). ``run/assemble.py`` applies
the plan first in its order.
"""

from torchtune_ac.activation_checkpointing.config import (
    ACConfig,
    ACConfigError,
    resolve_ac_plan,
    setup_activation_checkpointing,
)
from torchtune_ac.activation_checkpointing.mechanism import ACMode, ACPlan, apply_ac_plan

__all__ = [
    "ACConfig",
    "ACConfigError",
    "ACMode",
    "ACPlan",
    "apply_ac_plan",
    "resolve_ac_plan",
    "setup_activation_checkpointing",
]
