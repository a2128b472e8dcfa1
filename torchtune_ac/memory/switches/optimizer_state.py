"""The optimizer's state precision as a memory switch: 8-bit, 4-bit or the parameters' dtype, by the optimizer the
config names (mechanism and layouts: ``memory/optimizer_state.py``).

    optimizer:
      _component_: torchao.optim.AdamW8bit      # or AdamW4bit, or _AdamW with bf16_stochastic_round: true

It has no key of its own: the layout comes from ``optimizer._component_`` and its arguments. ``tune validate``
prints it with the memory plan; ``tune plan`` and ``ac_mode: auto`` count the state by it (the planner simulates
a stand-in for torchao's compiled step, and adds the state from the parameters' shapes); when nothing fits,
fp32 or bf16 AdamW suggests torchao's 8-bit AdamW.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import torch

from torchtune_ac.errors import UserError
from torchtune_ac.memory import optimizer_state
from torchtune_ac.memory.optimizer_state import StateLayout, layout_of, state_bytes
from torchtune_ac.memory.switch import (
    Alternative,
    MakeOptimizer,
    ModelSizes,
    SwitchContext,
    SwitchCost,
    SwitchDefaults,
)


@dataclass(frozen=True)
class OptimizerStateConfig:
    """No keys: the layout is read from ``optimizer._component_``."""


@dataclass(frozen=True)
class OptimizerState:
    """The setting: the optimizer's state layout (None: not known here, simulated), its ``_component_`` path, the
    parameters' dtype (that of the unquantized states), and the bytes per parameter it comes to for the run's model
    (None where no model was sized: a suggestion)."""

    layout: Optional[StateLayout]
    path: str = ""
    dtype: torch.dtype = torch.float32
    bytes_per_parameter: Optional[float] = None


class OptimizerStateSwitch(SwitchDefaults):
    name = "optimizer_state"
    label = "optimizer state"
    off = OptimizerState(None)
    order = 5
    config_class = OptimizerStateConfig

    def resolve(self, config: OptimizerStateConfig, ctx: SwitchContext) -> OptimizerState:
        if ctx.optimizer is None:
            return self.off
        layout = layout_of(ctx.optimizer.path, ctx.optimizer.kwargs)
        if layout is not None and layout.stochastic_rounding and ctx.dtype.itemsize != 2:
            raise UserError(
                f"optimizer.bf16_stochastic_round=true with dtype={layout.name(ctx.dtype)}: stochastic "
                "rounding applies to bf16 weights only; set dtype: bf16, or drop optimizer.bf16_stochastic_round"
            )
        per_parameter = None
        if layout is not None:
            shapes = [tuple(p.shape) for p in {id(p): p for p in ctx.model.parameters()}.values()]
            per_parameter = state_bytes(layout, shapes, ctx.dtype) / max(1, sum(math.prod(s) for s in shapes))
        return OptimizerState(layout, ctx.optimizer.path, ctx.dtype, per_parameter)

    def describe(self, setting: OptimizerState, vocab_size: Optional[int]) -> str:
        if not setting.path:
            return "as the optimizer allocates it"
        return optimizer_state.describe_layout(setting.layout, setting.path, setting.dtype, setting.bytes_per_parameter)

    def wrap_optimizer(self, setting: OptimizerState, make_optimizer: MakeOptimizer) -> MakeOptimizer:
        if setting.layout is None or not setting.layout.compiled:
            return make_optimizer
        return optimizer_state.announce_first_step(
            make_optimizer, f"{setting.path}: compiling its update for each parameter shape (tens of seconds on a "
                            "CPU, once per process) before the first step")

    def planner_optimizer(self, setting: OptimizerState, make_optimizer: MakeOptimizer) -> MakeOptimizer:
        counted = setting.layout is not None and setting.layout.counted
        return optimizer_state.stand_in_optimizer if counted else make_optimizer

    def planner_cost(self, setting: OptimizerState, sizes: ModelSizes) -> SwitchCost:
        if setting.layout is None or not setting.layout.counted:
            return SwitchCost()
        counted = state_bytes(setting.layout, sizes.shapes, sizes.dtype, sizes.world_size)
        return SwitchCost(device={"optimizer": counted - sizes.so_far.get("optimizer", 0)})

    def alternatives(self, setting: OptimizerState) -> list[Alternative]:
        if setting.layout is None or setting.layout.bits is not None or setting.layout.states != 2:
            return []
        eight_bit = layout_of(optimizer_state.EIGHT_BIT, {})
        return [Alternative(f"optimizer._component_={optimizer_state.EIGHT_BIT} (the ao extra)",
                            OptimizerState(eight_bit, optimizer_state.EIGHT_BIT))]

    def resume_record(self, setting: OptimizerState) -> dict:
        # Recorded only for a quantized state, so runs from before the switch existed still resume.
        if setting.layout is None or setting.layout.bits is None:
            return {}
        return {"optimizer_state": setting.layout.name(setting.dtype)}


SWITCH = OptimizerStateSwitch()
