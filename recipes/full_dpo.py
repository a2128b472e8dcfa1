"""Preference tuning by direct preference optimisation (DPO) of a Llama-style model: one device, or N processes
sharded with FSDP2.

    tune run full_dpo --config tiny/dpo
    tune run --nproc_per_node 2 full_dpo --config tiny/dpo

What is this recipe's own: its data (preference pairs, two rows each, ``data/preference.py``), its reference model
(the starting weights, frozen and sharded like the policy over the same mesh; with ``dpo.reference: precomputed``
only its log-probabilities, computed once before training, and the model freed) and its objective (the DPO loss
of ``training/dpo.py``, chosen and rejected in one forward). Everything else is the run layer's set-up
(``run/setup.py``), as for ``full_finetune``; the planner counts the pairs and the reference.

SIGTERM or a first Ctrl-C stops the run after the current step with a checkpoint (exit 143); a non-finite loss
or gradient norm stops it before the optimizer takes it in, saving nothing (exit 3).
"""

from __future__ import annotations

import copy
import functools
import logging
import sys
from typing import Optional

from torch import nn

from torchtune_ac.config.schema import FullDPOConfig
from torchtune_ac.data.batching import PAIRS
from torchtune_ac.run import preflight as library
from torchtune_ac.run.assemble import build_reference
from torchtune_ac.run.reference import precompute_reference
from torchtune_ac.run.setup import SetupParts, run_recipe
from torchtune_ac.training.dpo import DPOObjective, ReferenceMode, describe_dpo

CONFIG_SCHEMA = FullDPOConfig
# tune plan and the launcher's checks: the run layer's, for this recipe's config (its planner step counts the pairs
# and the reference: FullDPOConfig.preference_step).
plan, check_launch = library.plan, library.check_launch
log = logging.getLogger("torchtune_ac.full_dpo")


def preflight(cfg: FullDPOConfig, *, strict: bool = True, world_size: Optional[int] = 1) -> list[tuple[str, str]]:
    """``tune validate``'s lines: the run layer's, and what this recipe adds (the loss and its reference)."""
    return [("dpo", describe_dpo(cfg.dpo, cfg.ref_checkpoint_dir)),
            *library.preflight(cfg, strict=strict, world_size=world_size)]


def dpo_objective(cfg: FullDPOConfig, parts: SetupParts) -> DPOObjective:
    """The DPO loss against the reference: built before the policy (a resume continues the policy from its
    checkpoint, but keeps the reference it started from), sharded over the run's mesh; with
    ``dpo.reference: precomputed``, only its log-probabilities of the pairs the run reads are kept, and the model is
    freed before the policy and its optimizer exist (``run/reference.py``)."""
    ctx, plan = parts.run.ctx, parts.plan
    if ctx.is_rank_zero:
        log.info("dpo: %s", describe_dpo(cfg.dpo, cfg.ref_checkpoint_dir))
    meta = [copy.deepcopy(parts.model)]  # the same architecture, from the one meta build
    n_chunks = plan.memory.settings.loss_chunks

    def make_reference() -> nn.Module:  # taken from the list: only its caller holds the built reference
        return build_reference(meta.pop(), plan, ctx=ctx, mesh=parts.mesh, checkpoint_dir=cfg.reference_checkpoint_dir)

    if cfg.dpo.reference is ReferenceMode.PRECOMPUTED:
        precompute_reference(parts.run, make_reference, parts.data, parts.validation, length=plan.length,
                             batch_size=cfg.batch_size, pad_id=parts.tokenizer.pad_id, n_chunks=n_chunks)
        return DPOObjective(cfg.dpo, n_chunks=n_chunks, reference=None)
    return DPOObjective(cfg.dpo, n_chunks=n_chunks, reference=make_reference())


def run(cfg: FullDPOConfig) -> None:
    """Tune on preference pairs with the DPO loss (see the module docstring)."""
    run_recipe(cfg, batching=PAIRS, make_objective=functools.partial(dpo_objective, cfg))


if __name__ == "__main__":
    from torchtune_ac.cli import recipe_main

    sys.exit(recipe_main())
