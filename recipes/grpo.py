"""Reinforcement learning from verifiable rewards by group relative policy optimisation (GRPO, exact to TRL 1.16's
loss) of a Llama-style model: one device, or N processes sharded with FSDP2.

    tune run grpo --config tiny/grpo
    tune run --nproc_per_node 2 grpo --config tiny/grpo

What is this recipe's own: its data (prompts with the columns their rewards read, ``data/prompts.py``), its
rollouts (``num_generations`` completions per prompt sampled by the policy, scored by the reward functions,
``run/grpo.py``), its objective (the clipped policy-ratio loss of ``training/grpo.py``) and, with ``grpo.beta``, its
reference (the starting weights, frozen and sharded like the policy; none is loaded with ``beta: 0``). Everything
else is the run layer's set-up (``run/setup.py``), as for ``full_dpo``.

SIGTERM or a first Ctrl-C stops the run after the current step with a checkpoint (exit 143); a non-finite loss
or gradient norm, or a reward function that fails, stops it before the optimizer takes the step.
"""

from __future__ import annotations

import sys
from typing import Optional

from torchtune_ac.config.schema import FullGRPOConfig
from torchtune_ac.run import preflight as library
from torchtune_ac.run.grpo import run_grpo
from torchtune_ac.training.grpo import describe_grpo

CONFIG_SCHEMA = FullGRPOConfig
plan, check_launch = library.plan, library.check_launch


def preflight(cfg: FullGRPOConfig, *, strict: bool = True, world_size: Optional[int] = 1) -> list[tuple[str, str]]:
    """``tune validate``'s lines: the run layer's, and what this recipe adds (the loss and its reference)."""
    return [("grpo", describe_grpo(cfg.grpo)), *library.preflight(cfg, strict=strict, world_size=world_size)]


def run(cfg: FullGRPOConfig) -> None:
    """Train on the rewards of the policy's own completions with the GRPO loss (see the module docstring)."""
    run_grpo(cfg, reference_is_base=False)


if __name__ == "__main__":
    from torchtune_ac.cli import recipe_main

    sys.exit(recipe_main())
