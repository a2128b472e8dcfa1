"""Preference tuning by DPO with low-rank adapters (LoRA, DoRA; QLoRA with an NF4 base) of a Llama-style model: one
device, or N processes sharded with FSDP2.

    tune run lora_dpo --config tiny/lora_dpo
    tune run --nproc_per_node 2 lora_dpo --config tiny/lora_dpo

What is this recipe's own: its data (preference pairs, as ``full_dpo``'s) and its objective (the DPO loss of
``training/dpo.py``) against its reference, which is the policy's own base with the adapters off
(``lora.adapters_off``): no second model, as TRL does with a PEFT model (``dpo.reference: precomputed``: that base's
log-probabilities computed once before training). The adapters are the run layer's, as for
``lora_finetune``.

SIGTERM or a first Ctrl-C stops the run after the current step with a checkpoint (exit 143); a non-finite loss
or gradient norm stops it before the optimizer takes it in, saving nothing (exit 3).
"""

from __future__ import annotations

import copy
import functools
import logging
import sys
from typing import Optional, Union

from torch import nn

from torchtune_ac.config.schema import LoRADPOConfig
from torchtune_ac.lora.reference import BaseAsReference
from torchtune_ac.run import preflight as library
from torchtune_ac.data.batching import PAIRS
from torchtune_ac.run.assemble import build_reference
from torchtune_ac.run.reference import precompute_reference
from torchtune_ac.run.setup import SetupParts, run_recipe
from torchtune_ac.training.dpo import DPOObjective, ReferenceMode

CONFIG_SCHEMA = LoRADPOConfig
plan, check_launch = library.plan, library.check_launch
log = logging.getLogger("torchtune_ac.lora_dpo")


def describe_reference(cfg: LoRADPOConfig) -> str:
    """``tune validate``'s and the log's line on the loss and its reference."""
    how = ("its log-probabilities precomputed in one pass, that base then freed"
           if cfg.dpo.reference is ReferenceMode.PRECOMPUTED else "no second model")
    return f"{cfg.dpo.loss_type.value} loss, beta {cfg.dpo.beta:g}; reference: the base with the adapters off ({how})"


def preflight(cfg: LoRADPOConfig, *, strict: bool = True, world_size: Optional[int] = 1) -> list[tuple[str, str]]:
    """``tune validate``'s lines: the run layer's, and what this recipe adds (the loss and its reference)."""
    return [("dpo", describe_reference(cfg)), *library.preflight(cfg, strict=strict, world_size=world_size)]


def dpo_objective(cfg: LoRADPOConfig, parts: SetupParts) -> Union[BaseAsReference, DPOObjective]:
    """The DPO loss against the base: each batch's reference log-probabilities come from the policy itself with
    its adapters off, under ``no_grad``, before its own forward; with ``dpo.reference: precomputed``, from the
    base built alone (the same weights, no adapters) and run once over the pairs before the policy exists, as
    ``full_dpo``'s precomputed reference (``run/reference.py``)."""
    ctx, plan = parts.run.ctx, parts.plan
    if ctx.is_rank_zero:
        log.info("dpo: %s", describe_reference(cfg))
    n_chunks = plan.memory.settings.loss_chunks
    if cfg.dpo.reference is ReferenceMode.PRECOMPUTED:
        meta = [copy.deepcopy(parts.model)]

        def make_base() -> nn.Module:  # taken from the list: only its caller holds the built base
            return build_reference(meta.pop(), plan, ctx=ctx, mesh=parts.mesh, checkpoint_dir=cfg.checkpoint_dir)

        precompute_reference(parts.run, make_base, parts.data, parts.validation, length=plan.length,
                             batch_size=cfg.batch_size, pad_id=parts.tokenizer.pad_id, n_chunks=n_chunks)
        return DPOObjective(cfg.dpo, n_chunks=n_chunks, reference=None)
    return BaseAsReference(DPOObjective(cfg.dpo, n_chunks=n_chunks, reference=None))


def run(cfg: LoRADPOConfig) -> None:
    """Tune the adapters on preference pairs with the DPO loss (see the module docstring)."""
    run_recipe(cfg, batching=PAIRS, make_objective=functools.partial(dpo_objective, cfg))


if __name__ == "__main__":
    from torchtune_ac.cli import recipe_main

    sys.exit(recipe_main())
