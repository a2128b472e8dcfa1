"""Full fine-tuning of a Llama-style model: one device, or N processes sharded with FSDP2.

    tune run full_finetune --config tiny/full
    tune run --nproc_per_node 2 full_finetune --config tiny/full

What is this recipe's own: its data (instruction, chat or text samples, through the tokenizer) and its objective
(the next-token loss, the memory plan's: whole logits or chunked). Everything else is the run layer's
(``torchtune_ac/run/``), shared with every recipe: the process context and stop signals (``session.py``), the plan
resolved once (``plan.py``), the set-up (``setup.py``), the model assembled in one written order (``assemble.py``),
the loop with its logging, saving and resume (``loop.py``).

SIGTERM or a first Ctrl-C stops the run after the current step with a checkpoint (exit 143); a non-finite loss
or gradient norm stops it before the optimizer takes it in, saving nothing (exit 3).
"""

from __future__ import annotations

import sys

from torchtune_ac.config.schema import FullFinetuneConfig
from torchtune_ac.data.batching import SAMPLES
from torchtune_ac.run import preflight as library
from torchtune_ac.run.setup import run_recipe

CONFIG_SCHEMA = FullFinetuneConfig
# tune validate, tune plan and the launcher's checks: the run layer's, for this recipe's config.
preflight, plan, check_launch = library.preflight, library.plan, library.check_launch


def run(cfg: FullFinetuneConfig) -> None:
    """Fine-tune on samples with the next-token loss (see the module docstring)."""
    run_recipe(cfg, batching=SAMPLES)


if __name__ == "__main__":
    from torchtune_ac.cli import recipe_main

    sys.exit(recipe_main())
