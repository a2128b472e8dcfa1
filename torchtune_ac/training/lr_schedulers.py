"""Learning-rate schedules, instantiated from the config's ``lr_scheduler`` component.

The recipe passes the optimizer and ``num_training_steps`` (the total number of optimizer steps of the run).
"""

from __future__ import annotations

import math

from torch.optim import Optimizer
from torch.optim.lr_scheduler import LambdaLR

from torchtune_ac.component_marker import config_component
from torchtune_ac.errors import UserError


@config_component
def cosine_schedule_with_warmup(
    optimizer: Optimizer,
    num_training_steps: int,
    *,
    num_warmup_steps: int = 0,
    min_lr_ratio: float = 0.0,
) -> LambdaLR:
    """Linear warm-up from 0 to the optimizer's lr over ``num_warmup_steps``, then cosine decay to
    ``min_lr_ratio * lr`` at ``num_training_steps``.

    Raises:
        UserError: negative warm-up, or ``min_lr_ratio`` outside [0, 1].
    """
    if num_warmup_steps < 0:
        raise UserError(f"lr_scheduler.num_warmup_steps={num_warmup_steps}: must be >= 0")
    if not 0.0 <= min_lr_ratio <= 1.0:
        raise UserError(f"lr_scheduler.min_lr_ratio={min_lr_ratio}: must be between 0 and 1")

    def lr_factor(step: int) -> float:
        if step < num_warmup_steps:
            return (step + 1) / (num_warmup_steps + 1)
        decay_steps = max(1, num_training_steps - num_warmup_steps)
        progress = min(1.0, (step - num_warmup_steps) / decay_steps)
        return min_lr_ratio + (1.0 - min_lr_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))

    return LambdaLR(optimizer, lr_factor)


@config_component
def constant_schedule(optimizer: Optimizer, num_training_steps: int) -> LambdaLR:
    """The optimizer's lr at every step (``num_training_steps`` is accepted for a uniform interface)."""
    del num_training_steps
    return LambdaLR(optimizer, lambda step: 1.0)
