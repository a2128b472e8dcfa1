"""Full fine-tuning of a Llama-style model: one device, or N processes sharded with FSDP2.

    tune run full_finetune --config tiny/full
    tune run --nproc_per_node 2 full_finetune --config tiny/full

What is this recipe's own: its data (instruction, chat or text samples, through the tokenizer) and its step (the
next-token loss over every micro-batch, one optimizer step). Everything else is the run layer's
(``torchtune_ac/run/``): the process context and stop signals (``session.py``), the plan resolved once
(``plan.py``), the model assembled in one written order (``assemble.py``), the loop with its logging, saving and
resume (``loop.py``). Another recipe composes the same, with its own data and step.

SIGTERM or a first Ctrl-C stops the run after the current step with a checkpoint (exit 143); a non-finite loss
or gradient norm stops it before the optimizer takes it in, saving nothing (exit 3).
"""

from __future__ import annotations

import logging
import sys
from pathlib import Path
from typing import Sequence

from tqdm.contrib.logging import logging_redirect_tqdm

from torchtune_ac.config.meta_model import build_meta_model
from torchtune_ac.config.schema import FullFinetuneConfig
from torchtune_ac.run import messages, preflight as library
from torchtune_ac.run.assemble import build_training
from torchtune_ac.run.loop import Batch, Trainer
from torchtune_ac.run.phases import (
    build_data,
    build_validation,
    check_disk_space,
    choose_resume,
    estimate_checkpoint_size,
    restore,
)
from torchtune_ac.run.session import Run, log_plan, open_run, plan_run
from torchtune_ac.training.evaluation import Evaluation, evaluate_objective
from torchtune_ac.training.step import StepResult, train_step

CONFIG_SCHEMA = FullFinetuneConfig
# tune validate, tune plan and the launcher's checks: the run layer's, for this recipe's config.
preflight, plan, check_launch = library.preflight, library.plan, library.check_launch
log = logging.getLogger("torchtune_ac.full_finetune")


class FullFinetuneRecipe:
    def __init__(self, cfg: FullFinetuneConfig, run: Run) -> None:
        self.cfg, self.run = cfg, run

    def setup(self) -> Trainer:
        cfg, run, ctx = self.cfg, self.run, self.run.ctx
        tokenizer = cfg.tokenizer.instantiate()  # this process's one tokenizer
        model = build_meta_model(cfg.model, cfg.checkpoint_dir)  # ...and its one meta build of the model
        plan = plan_run(run, model, tokenizer=tokenizer)  # rank 0's, checked, before anything heavy
        data = build_data(cfg, tokenizer, ctx)
        self.plan = plan.with_data(data.samples, len(data.loader), described=data.described, unit=data.unit)
        log_plan(run, self.plan)
        resume_from = choose_resume(cfg, ctx).checkpoint
        self.training = build_training(
            model, ctx=ctx, dtype=self.plan.dtype, memory=self.plan.memory, fsdp=self.plan.fsdp,
            compile_blocks=self.plan.compile, checkpoint_dir=cfg.checkpoint_dir, seed=cfg.seed,
            load_weights=resume_from is None,  # a resume loads its own
            make_optimizer=cfg.optimizer.instantiate,
            make_scheduler=None if cfg.lr_scheduler is None else (
                lambda optimizer: cfg.lr_scheduler.instantiate(optimizer,
                                                               num_training_steps=self.plan.length.total_steps)),
        )
        validation = build_validation(cfg, tokenizer, ctx)
        if resume_from is not None:
            run.progress = restore(self.plan, ctx, resume_from, self.training, data)
            run.last_checkpoint = resume_from
        elif cfg.resume_from_checkpoint:
            log.info(messages.no_checkpoint_yet(cfg.output_dir))
        tokenizer_dir = Path(tokenizer.path).parent  # its files go into every checkpoint
        check_disk_space(self.plan, ctx, estimate_checkpoint_size(cfg, self.training.model, tokenizer_dir),
                         self.plan.save.saves(run.progress.step, self.plan.length))
        trainer = Trainer(run, self.plan, self.training, data, step=self.step, tokenizer=tokenizer,
                          validation=validation, evaluate=self.evaluate)
        trainer.open_metrics()
        return trainer

    def step(self, micro_batches: Sequence[Batch]) -> StepResult:
        """One optimizer step: the next-token loss of every micro-batch, then the stepper's update."""
        training = self.training
        return train_step(training.model, training.stepper, micro_batches, ctx=self.run.ctx,
                          objective=training.objective, clip_grad_norm=self.cfg.clip_grad_norm)

    def evaluate(self, batches) -> Evaluation:
        """The validation loss: the mean next-token loss per target over the held-out batches."""
        return evaluate_objective(self.training.model, batches, ctx=self.run.ctx, objective=self.training.objective)


def run(cfg: FullFinetuneConfig) -> None:
    """Run the recipe; cleanup always runs (after a success, every rank shuts down together)."""
    with open_run(cfg) as run_:
        trainer = FullFinetuneRecipe(cfg, run_).setup()
        with logging_redirect_tqdm():
            trainer.train()


if __name__ == "__main__":
    from torchtune_ac.cli import recipe_main

    sys.exit(recipe_main())
