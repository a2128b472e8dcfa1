"""The memory features, listed once, in order: the order of ``tune validate``'s lines, of the planner's costs
(each feature's ``planner_cost`` sees the estimate with the ones before it counted) and of its suggestions when
nothing fits. Each is declared in its own module, beside its mechanism (see ``feature.py``).

The order in which a run *applies* them is another, written in one function: ``run/assemble.py``.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Mapping, Optional

from torchtune_ac.memory import activation_offloading, chunked_loss, cpu_offload, optimizer_in_backward, optimizer_state
from torchtune_ac.memory.feature import Feature, ResolveInputs
from torchtune_ac.memory.optimizer_state import OptimizerState
from torchtune_ac.models.families import transformer_blocks
from torchtune_ac.activation_checkpointing.mechanism import ACPlan


def _resolve_ac(inputs: ResolveInputs) -> Optional[ACPlan]:
    """The AC plan of the keys for the model's blocks, or None for ``ac_mode: auto`` (``memory/plan.py`` has the
    planner choose, once every other feature is known)."""
    return None if inputs.ac.is_auto else inputs.ac.resolve(len(transformer_blocks(inputs.model)))


# Activation checkpointing: its keys, plan and mechanism are activation_checkpointing/'s;
# its cost is simulated (the planner runs the step with the plan applied) and the planner compares every plan, so
# it has nothing more to add or suggest.
ACTIVATION_CHECKPOINTING = Feature(name="ac", label="activation checkpointing", off=None, resolve=_resolve_ac,
                                   describe=lambda plan, vocab_size: str(plan))

FEATURES: tuple[Feature, ...] = (
    ACTIVATION_CHECKPOINTING,
    optimizer_state.FEATURE,
    optimizer_in_backward.FEATURE,
    chunked_loss.FEATURE,
    activation_offloading.FEATURE,
    cpu_offload.FEATURE,
)
# Every feature but AC: the workload's settings (AC is the plan the planner compares, not a setting of the step).
STEP_FEATURES = FEATURES[1:]


@dataclass(frozen=True)
class MemorySettings:
    """The setting of every memory feature but AC (whose plan the planner compares, not a setting of the step), one
    typed field per feature, named as the feature; a field left out is its feature's ``off`` setting (a plan built
    for AC alone). A test keeps the fields equal to ``STEP_FEATURES``."""

    optimizer_state: OptimizerState = optimizer_state.OFF
    optimizer_in_bwd: bool = False
    loss_chunks: int = 1
    enable_activation_offloading: bool = False
    cpu_offload: bool = False

    def of(self, feature: Feature) -> Any:
        """The setting of ``feature`` (the generic code's way in: the plan's lines, the planner's costs)."""
        return getattr(self, feature.name)

    def changed(self, changes: Mapping[str, Any]) -> "MemorySettings":
        """These settings with some features' settings changed, by feature name (the planner's suggestions)."""
        return dataclasses.replace(self, **changes)
