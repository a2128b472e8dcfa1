"""The optimizer step in backward as a memory switch: each parameter is stepped as soon as its gradient is
final, and the gradient freed at once (mechanism: ``memory/optimizer_in_backward.py``).

The planner simulates the step with the optimizer in backward, so it needs no cost declared here; under FSDP2 the
root's gradients (embeddings, output) are reduced, and so stepped, only when backward ends, which the simulation
keeps (``planner._LiveStorages``): they stay whole on every process until then.

    optimizer_in_bwd: false | true
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Iterable, Optional

from torch import nn

from torchtune_ac.errors import UserError
from torchtune_ac.memory.optimizer_in_backward import build_optimizer
from torchtune_ac.memory.switch import Alternative, SwitchContext, SwitchDefaults


@dataclass(frozen=True)
class OptimizerInBackwardConfig:
    # Step each parameter's optimizer in backward, as soon as its gradient is final, and free the gradient.
    optimizer_in_bwd: bool = False


class OptimizerInBackwardSwitch(SwitchDefaults):
    name = "optimizer_in_bwd"
    label = "optimizer step"
    off = False
    order = 10
    config_class = OptimizerInBackwardConfig

    def resolve(self, config: OptimizerInBackwardConfig, ctx: SwitchContext) -> bool:
        if config.optimizer_in_bwd and ctx.clip_grad_norm is not None:
            raise UserError(
                f"optimizer_in_bwd=true with clip_grad_norm={ctx.clip_grad_norm}: in backward each parameter is "
                "updated as soon as its gradient is ready, before the total norm that clipping scales by is known; "
                "set clip_grad_norm: null, or optimizer_in_bwd: false"
            )
        return config.optimizer_in_bwd

    def describe(self, setting: bool, vocab_size: Optional[int]) -> str:
        return ("in backward: each parameter stepped as its gradient is ready, gradients freed at once"
                if setting else "after backward")

    def build_stepper(self, setting: bool, make_optimizer: Callable[[Iterable[nn.Parameter]], Any],
                      model: nn.Module) -> Any:
        return build_optimizer(make_optimizer, model, in_backward=True) if setting else None

    def alternatives(self, setting: bool) -> list[Alternative]:
        if setting:
            return []
        # Gradients accumulated over micro-batches must live until the last one, so the step in backward frees
        # them only without accumulation (torchtune requires that outright).
        return [Alternative("optimizer_in_bwd=true (with clip_grad_norm: null, gradient_accumulation_steps: 1)", True,
                            {"clip_grad_norm": None, "gradient_accumulation_steps": 1})]

    def resume_record(self, setting: bool) -> dict:
        # Recorded only when on, so runs from before the switch existed still resume.
        return {"optimizer_in_bwd": True} if setting else {}


SWITCH = OptimizerInBackwardSwitch()
