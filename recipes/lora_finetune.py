"""Fine-tuning with low-rank adapters (LoRA, DoRA; QLoRA with an NF4 base) of a Llama-style model: one device, or N
processes sharded with FSDP2.

    tune run lora_finetune --config tiny/lora
    tune run --nproc_per_node 2 lora_finetune --config tiny/lora
    tune run lora_finetune --config tiny/qlora

What is this recipe's own: its data (samples, as ``full_finetune``'s) and its objective (the next-token loss, the
memory plan's). The adapters are the run layer's: the ``adapter:`` section is applied in its slot of the written
order (``run/assemble.py``), by ``torchtune_ac/lora/``, and each checkpoint holds them in PEFT's format.

SIGTERM or a first Ctrl-C stops the run after the current step with a checkpoint (exit 143); a non-finite loss
or gradient norm stops it before the optimizer takes it in, saving nothing (exit 3).
"""

from __future__ import annotations

import sys

from torchtune_ac.config.schema import LoRAFinetuneConfig
from torchtune_ac.run import preflight as library
from torchtune_ac.data.batching import SAMPLES
from torchtune_ac.run.setup import run_recipe

CONFIG_SCHEMA = LoRAFinetuneConfig
# tune validate, tune plan and the launcher's checks: the run layer's, for this recipe's config.
preflight, plan, check_launch = library.preflight, library.plan, library.check_launch


def run(cfg: LoRAFinetuneConfig) -> None:
    """Fine-tune the adapters on samples with the next-token loss (see the module docstring)."""
    run_recipe(cfg, batching=SAMPLES)


if __name__ == "__main__":
    from torchtune_ac.cli import recipe_main

    sys.exit(recipe_main())
