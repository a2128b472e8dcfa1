"""Activation checkpointing as a memory switch: which blocks recompute their activations in backward.

Its keys (``enable_activation_checkpointing``, ``ac_mode``, ``ac_option``, ``ac_memory_budget_gib``) are
``ACConfig``, validated by the AC module's own rules; the mechanism is ``memory/activation_checkpointing.py``.
``ac_mode: auto`` is resolved last, by the planner, once every other switch is known (``plan.py``); its
planner cost is simulated (the planner runs the step with the plan applied), and the planner already compares
every AC plan, so it suggests nothing more.
"""

from __future__ import annotations

from typing import Optional

from torch import nn

from torchtune_ac.memory.activation_checkpointing import ACConfig, ACPlan, apply_ac_plan
from torchtune_ac.memory.switch import SwitchContext, SwitchDefaults
from torchtune_ac.models.families import transformer_blocks


class ActivationCheckpointingSwitch(SwitchDefaults):
    name = "ac"
    label = "activation checkpointing"
    off = None
    order = 0
    config_class = ACConfig

    def resolve(self, config: ACConfig, ctx: SwitchContext) -> Optional[ACPlan]:
        """The AC plan for the model's blocks, or None for ``ac_mode: auto`` (the planner chooses)."""
        return None if config.is_auto else config.resolve(len(transformer_blocks(ctx.model)))

    def describe(self, setting: ACPlan, vocab_size: Optional[int]) -> str:
        return str(setting)

    def apply_to_model(self, model: nn.Module, setting: ACPlan) -> None:
        apply_ac_plan(model, setting)


SWITCH = ActivationCheckpointingSwitch()
