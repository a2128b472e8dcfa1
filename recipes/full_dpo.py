"""Preference tuning by direct preference optimisation (DPO) of a Llama-style model: one device, or N processes
sharded with FSDP2.

    tune run full_dpo --config tiny/dpo
    tune run --nproc_per_node 2 full_dpo --config tiny/dpo

What is this recipe's own: its data (preference pairs, two rows each, ``data/preference.py``), its reference model
(the starting weights, frozen and sharded like the policy; with ``dpo.reference: precomputed`` only its
log-probabilities of the pairs the run reads, computed once before training by ``run/reference.py``, and the model
freed) and its step (the DPO loss of ``training/dpo.py``, chosen and rejected in one forward). Everything else is
the run layer's, as for ``full_finetune``: the process context and stop signals, the plan resolved once (the
planner counts the reference), the model assembled in one written order, the loop with its logging, validation,
saving and resume.

SIGTERM or a first Ctrl-C stops the run after the current step with a checkpoint (exit 143); a non-finite loss
or gradient norm stops it before the optimizer takes it in, saving nothing (exit 3).
"""

from __future__ import annotations

import copy
import logging
import sys
from pathlib import Path
from typing import Iterable, Optional, Sequence

from torch import nn
from tqdm.contrib.logging import logging_redirect_tqdm

from torchtune_ac.config.meta_model import build_meta_model
from torchtune_ac.config.schema import FullDPOConfig
from torchtune_ac.run import messages, preflight as library
from torchtune_ac.run.assemble import build_reference, build_training
from torchtune_ac.run.loop import Batch, Trainer
from torchtune_ac.run.phases import (
    PAIRS,
    build_data,
    build_validation,
    check_disk_space,
    choose_resume,
    estimate_checkpoint_size,
    restore,
)
from torchtune_ac.run.reference import precompute_reference
from torchtune_ac.run.session import Run, log_plan, open_run, plan_run
from torchtune_ac.training.dpo import DPOObjective, ReferenceMode, describe_dpo
from torchtune_ac.training.evaluation import Evaluation, evaluate_objective
from torchtune_ac.training.step import StepResult, train_step

CONFIG_SCHEMA = FullDPOConfig
# tune plan and the launcher's checks: the run layer's, for this recipe's config (its planner step counts the pairs
# and the reference: FullDPOConfig.preference_step).
plan, check_launch = library.plan, library.check_launch
log = logging.getLogger("torchtune_ac.full_dpo")


def preflight(cfg: FullDPOConfig, *, strict: bool = True, world_size: Optional[int] = 1) -> list[tuple[str, str]]:
    """``tune validate``'s lines: the run layer's, and what this recipe adds (the loss and its reference)."""
    return [("dpo", describe_dpo(cfg.dpo, cfg.ref_checkpoint_dir)),
            *library.preflight(cfg, strict=strict, world_size=world_size)]


class FullDPORecipe:
    def __init__(self, cfg: FullDPOConfig, run: Run) -> None:
        self.cfg, self.run = cfg, run

    def setup(self) -> Trainer:
        cfg, run, ctx = self.cfg, self.run, self.run.ctx
        tokenizer = cfg.tokenizer.instantiate()
        model = build_meta_model(cfg.model, cfg.checkpoint_dir)
        reference_model = [copy.deepcopy(model)]  # the same architecture, from the one meta build
        plan = plan_run(run, model, tokenizer=tokenizer)
        data = build_data(cfg, tokenizer, ctx, batching=PAIRS)
        self.plan = plan = plan.with_data(data.samples, len(data.loader), described=data.described, unit=data.unit)
        log_plan(run, plan)
        if ctx.is_rank_zero:
            log.info("dpo: %s", describe_dpo(cfg.dpo, cfg.ref_checkpoint_dir))
        validation = build_validation(cfg, tokenizer, ctx, batching=PAIRS)
        n_chunks = plan.memory.setting("loss_chunks")

        def make_reference() -> nn.Module:  # taken from the list: only its caller holds the built reference
            return build_reference(reference_model.pop(), ctx=ctx, dtype=plan.dtype, memory=plan.memory,
                                   fsdp=plan.fsdp, checkpoint_dir=cfg.reference_checkpoint_dir, seed=cfg.seed)

        # The reference first: a resume continues from its checkpoint, but keeps the reference it started from.
        reference = None
        if cfg.dpo.reference is ReferenceMode.PRECOMPUTED:
            # Its log-probabilities of the pairs the run reads; it is freed before the policy and its optimizer exist.
            precompute_reference(run, make_reference, data, validation, length=plan.length,
                                 batch_size=cfg.batch_size, pad_id=tokenizer.pad_id, n_chunks=n_chunks)
        else:
            reference = make_reference()
        self.objective = DPOObjective(cfg.dpo, n_chunks=n_chunks, reference=reference)
        resume_from = choose_resume(cfg, ctx).checkpoint
        self.training = build_training(
            model, ctx=ctx, dtype=plan.dtype, memory=plan.memory, fsdp=plan.fsdp, compile_blocks=plan.compile,
            checkpoint_dir=cfg.checkpoint_dir, seed=cfg.seed, load_weights=resume_from is None,
            make_optimizer=cfg.optimizer.instantiate,
            make_scheduler=None if cfg.lr_scheduler is None else (
                lambda optimizer: cfg.lr_scheduler.instantiate(optimizer, num_training_steps=plan.length.total_steps)),
        )
        if resume_from is not None:
            run.progress = restore(plan, ctx, resume_from, self.training, data)
            run.last_checkpoint = resume_from
        elif cfg.resume_from_checkpoint:
            log.info(messages.no_checkpoint_yet(cfg.output_dir))
        tokenizer_dir = Path(tokenizer.path).parent
        check_disk_space(plan, ctx, estimate_checkpoint_size(cfg, self.training.model, tokenizer_dir),
                         plan.save.saves(run.progress.step, plan.length))
        trainer = Trainer(run, plan, self.training, data, step=self.step, tokenizer=tokenizer,
                          validation=validation, evaluate=self.evaluate)
        trainer.open_metrics()
        return trainer

    def step(self, micro_batches: Sequence[Batch]) -> StepResult:
        """One optimizer step: the DPO loss of every micro-batch's pairs (its rewards as metrics), then the update."""
        training = self.training
        return train_step(training.model, training.stepper, micro_batches, ctx=self.run.ctx,
                          objective=self.objective, clip_grad_norm=self.cfg.clip_grad_norm)

    def evaluate(self, batches: Iterable[Batch]) -> Evaluation:
        """The validation loss and reward accuracy (and the other rewards) over the held-out pairs."""
        return evaluate_objective(self.training.model, batches, ctx=self.run.ctx, objective=self.objective)


def run(cfg: FullDPOConfig) -> None:
    """Run the recipe; cleanup always runs (after a success, every rank shuts down together)."""
    with open_run(cfg) as run_:
        trainer = FullDPORecipe(cfg, run_).setup()
        with logging_redirect_tqdm():
            trainer.train()


if __name__ == "__main__":
    from torchtune_ac.cli import recipe_main

    sys.exit(recipe_main())
