"""GRPO with low-rank adapters (LoRA, DoRA; QLoRA with an NF4 base) of a Llama-style model: one device, or N
processes sharded with FSDP2.

    tune run lora_grpo --config tiny/lora_grpo
    tune run --nproc_per_node 2 lora_grpo --config tiny/lora_grpo

What is this recipe's own: ``grpo``'s prompts, rollouts and objective, with the reference (``grpo.beta`` > 0) the
policy's own base with its adapters off (``lora.adapters_off``): no second model, as TRL does with a PEFT model.
The adapters are the run layer's, as for ``lora_finetune``.

SIGTERM or a first Ctrl-C stops the run after the current step with a checkpoint (exit 143); a non-finite loss
or gradient norm, or a reward function that fails, stops it before the optimizer takes the step.
"""

from __future__ import annotations

import sys
from typing import Optional

from torchtune_ac.config.schema import LoRAGRPOConfig
from torchtune_ac.run import preflight as library
from torchtune_ac.run.grpo import run_grpo
from torchtune_ac.training.grpo import describe_grpo

CONFIG_SCHEMA = LoRAGRPOConfig
plan, check_launch = library.plan, library.check_launch


def preflight(cfg: LoRAGRPOConfig, *, strict: bool = True, world_size: Optional[int] = 1) -> list[tuple[str, str]]:
    """``tune validate``'s lines: the run layer's, and what this recipe adds (the loss; its reference, the base)."""
    return [("grpo", describe_grpo(cfg.grpo).replace("to the starting weights", "to the base, adapters off")),
            *library.preflight(cfg, strict=strict, world_size=world_size)]


def run(cfg: LoRAGRPOConfig) -> None:
    """Tune the adapters on the rewards of the policy's own completions (see the module docstring)."""
    run_grpo(cfg, reference_is_base=True)


if __name__ == "__main__":
    from torchtune_ac.cli import recipe_main

    sys.exit(recipe_main())
