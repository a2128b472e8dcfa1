"""Full fine-tuning of a Llama-style model: one device, or N processes sharded with FSDP2.

    tune run full_finetune --config tiny/full
    tune run --nproc_per_node 2 full_finetune --config tiny/full

The recipe only orders library calls: setup (the run layer's phases, ``torchtune_ac/run/phases.py``) -> train
(train_step, save_checkpoint) -> cleanup (always). Everything it calls lives in torchtune_ac, so another recipe
composes the same phases rather than copying them.

SIGTERM or a first Ctrl-C stops the run after the current step with a checkpoint (exit 143); a non-finite loss
or gradient norm stops it before the optimizer takes it in, saving nothing (exit 3).
"""

from __future__ import annotations

import logging
import os
import sys
import time
from pathlib import Path
from typing import Optional

import torch
from tqdm.contrib.logging import logging_redirect_tqdm

from torchtune_ac.checkpoint import (
    Progress,
    TrainerState,
    create_output_dir,
    hold_output_dir,
    read_hf_config,
    save_checkpoint,
)
from torchtune_ac.config.planning import PlanTable, plan_table
from torchtune_ac.config.preflight import describe_sharding, preflight_full_finetune, run_hyperparameters, run_shape
from torchtune_ac.config.schema import FullFinetuneConfig
from torchtune_ac.data.samples import count_of
from torchtune_ac.models import hf_model_files
from torchtune_ac.observability.metric_logging import RunLog, open_run_log
from torchtune_ac.observability.metrics import MemoryPeaks
from torchtune_ac.observability.progress import ProgressReporter
from torchtune_ac.run import messages
from torchtune_ac.run.phases import (
    SavePolicy,
    build_data,
    build_model,
    build_scheduler,
    build_validation,
    check_disk_space,
    choose_resume,
    estimate_checkpoint_size,
    restore,
    start_run,
)
from torchtune_ac.runtime.distributed import destroy_distributed, init_distributed
from torchtune_ac.runtime.non_finite import NonFiniteError
from torchtune_ac.runtime.stop import StopSignals
from torchtune_ac.training.evaluation import evaluate
from torchtune_ac.training.step import move_batch, train_step

CONFIG_SCHEMA = FullFinetuneConfig
log = logging.getLogger("torchtune_ac.full_finetune")


def preflight(cfg: FullFinetuneConfig, *, strict: bool = True, world_size: Optional[int] = 1) -> list[tuple[str, str]]:
    """Start-up checks and summary (``tune validate`` calls this with ``strict=False``; the launcher with the
    world size it is about to start, or None when it cannot tell)."""
    report = preflight_full_finetune(cfg, strict=strict, world_size=world_size)
    return report.summary + [("warning", w) for w in report.warnings]


def plan(cfg: FullFinetuneConfig, *, world_size: int, budget_gib: Optional[float]) -> PlanTable:
    """``tune plan``: the memory per process of every AC setting for this recipe's step (``budget_gib`` None: the
    config's ``ac_memory_budget_gib``)."""
    budget = budget_gib if budget_gib is not None else cfg.ac.ac_memory_budget_gib
    return plan_table(cfg, world_size=world_size, budget_gib=budget)


class FullFinetuneRecipe:
    def __init__(self, cfg: FullFinetuneConfig) -> None:
        self.cfg = cfg
        self.metrics: Optional[RunLog] = None
        self.last_checkpoint: Optional[Path] = None
        self.progress = Progress()
        # Rank 0 (of the launcher's RANK; a single process is rank 0) says at once what a signal will do.
        self.stop = StopSignals(
            announce=os.environ.get("RANK", "0") == "0",
            requested=lambda name: messages.stop_requested(name, self.progress.step + 1, self.last_checkpoint),
            aborted=lambda: messages.aborted(self.progress.step + 1, self.last_checkpoint),
        )

    def setup(self) -> None:
        cfg = self.cfg
        self.run = run = start_run(cfg)
        resume_from = choose_resume(cfg).checkpoint
        self.tokenizer = cfg.tokenizer.instantiate()
        self.tokenizer_dir = Path(self.tokenizer.path).parent  # its files go into every checkpoint
        # The saved config.json keeps every key of the one the run started from that training did not change.
        self.base_config = read_hf_config(cfg.checkpoint_dir) if cfg.checkpoint_dir is not None else None
        self.training = build_model(cfg, run, load_weights=resume_from is None)  # a resume loads its own
        self.data = build_data(cfg, self.tokenizer, run.ctx)
        self.validation = build_validation(cfg, self.tokenizer, run.ctx)
        self.scheduler = build_scheduler(cfg, self.training.stepper, self.data.total_steps)
        self.save_policy = SavePolicy(cfg.save_every_n_steps)
        if resume_from is not None:
            self.progress = restore(cfg, run, resume_from, self.training, self.scheduler, self.data)
            self.last_checkpoint = resume_from
        elif cfg.resume_from_checkpoint:
            log.info(messages.no_checkpoint_yet(cfg.output_dir))
        check_disk_space(cfg, run.ctx, estimate_checkpoint_size(cfg, self.training.model, self.tokenizer_dir),
                         self.save_policy.saves(self.progress.step, self.data))
        if run.ctx.is_rank_zero:
            create_output_dir(cfg.output_dir)
            tracker = cfg.metric_logger.instantiate() if cfg.metric_logger is not None else None
            # A resume drops what the interrupted run logged after its checkpoint (all of it without one).
            self.metrics = open_run_log(cfg.output_dir, tracker, config=cfg,
                                        resume_after_step=self.progress.step if cfg.resume_from_checkpoint else None)
        ctx = run.ctx
        global_batch = cfg.batch_size * cfg.gradient_accumulation_steps * ctx.world_size
        unit = self.data.unit
        for line in (
            f"world size {ctx.world_size} on {ctx.device} ({cfg.dtype.value}), {torch.get_num_threads()} thread(s) per "
            "process",
            f"model {cfg.model.path}: {run.report.n_parameters:,} parameters, {run.plan.ac.n_layers} layers",
            *(f"{label}: {value}" for label, value in run.plan.describe()),
            f"fsdp: {describe_sharding(cfg, ctx.world_size, run.plan)}",
            f"global batch {count_of(global_batch, unit)} ({cfg.batch_size} x {cfg.gradient_accumulation_steps} "
            f"accumulation x {count_of(ctx.world_size, 'process', 'processes')}); {self.data.described}, "
            f"{count_of(self.data.steps_per_epoch, 'step')} per epoch, {count_of(cfg.epochs, 'epoch')}",
        ):
            log.info(line)

    def train(self) -> None:
        cfg, ctx, data, training = self.cfg, self.run.ctx, self.data, self.training
        accum = cfg.gradient_accumulation_steps
        # A bar on a terminal; plain lines every log_every_n_steps in a log file (no carriage returns).
        progress = ProgressReporter(total=data.total_steps, initial=self.progress.step, every=cfg.log_every_n_steps,
                                    enabled=ctx.is_rank_zero)
        started = time.perf_counter()
        first_step, last_loss = self.progress.step, float("nan")
        peaks = MemoryPeaks(ctx.device)  # each logged line: the peaks since the line before
        if (stop := self.stop.agreed(ctx)) is not None:  # a signal during set-up: nothing new to save
            raise self.stopped(stop, saved=False)
        for epoch in range(self.progress.epoch, cfg.epochs):
            data.loader.set_epoch(epoch)
            skip = self.progress.step_in_epoch if epoch == self.progress.epoch else 0
            data.loader.skip_steps(skip * accum)
            batches = iter(data.loader)
            for step_in_epoch in range(skip, data.steps_per_epoch):
                step_start = time.perf_counter()
                micro = [move_batch(next(batches), ctx.device) for _ in range(accum)]
                try:
                    result = train_step(training.model, training.stepper, micro, ctx=ctx, objective=training.objective,
                                        clip_grad_norm=cfg.clip_grad_norm)
                except NonFiniteError as err:
                    raise messages.diverged(err, self.progress, self.last_checkpoint,
                                            announce=ctx.is_rank_zero) from None
                # A float now: torchao's optimizers keep the learning rate in a tensor the scheduler updates in place.
                lr = float(training.stepper.optimizer.param_groups[0]["lr"])
                if self.scheduler is not None:
                    self.scheduler.step()
                elapsed = time.perf_counter() - step_start
                self.progress = Progress(self.progress.step + 1, epoch, step_in_epoch + 1)
                last_loss = result.loss
                tokens_per_second = result.input_tokens / elapsed
                target_tokens_per_second = result.target_tokens / elapsed
                epoch_done = step_in_epoch + 1 == data.steps_per_epoch
                val_loss = None
                if self.validation is not None and self.validation.due(self.progress.step, epoch_done=epoch_done):
                    val_loss = evaluate(training.model, self.validation.batches(), ctx=ctx,
                                        objective=training.objective)
                    log.info("step %d: validation loss %.4f", self.progress.step, val_loss)
                # Every log_every_n_steps-th step, each validated one, and the run's last, whatever the period.
                logged = (self.progress.step % cfg.log_every_n_steps == 0 or val_loss is not None
                          or self.progress.step == data.total_steps)
                if self.metrics is not None and logged:
                    self.metrics.write(
                        {
                            "step": self.progress.step,
                            "epoch": epoch,
                            "loss": result.loss,
                            "lr": lr,
                            "grad_norm": result.grad_norm,
                            "tokens_per_second": tokens_per_second,
                            **peaks.since_last(),
                            "tokens": result.input_tokens,
                            "target_tokens": result.target_tokens,
                            "step_time_s": elapsed,
                            "target_tokens_per_second": target_tokens_per_second,
                            **({"val_loss": val_loss} if val_loss is not None else {}),
                        }
                    )
                progress.update(step=self.progress.step, loss=result.loss, lr=lr, tokens_per_second=tokens_per_second,
                                target_tokens_per_second=target_tokens_per_second, val_loss=val_loss)
                stop = self.stop.agreed(ctx)  # every rank stops after the same step
                if stop is not None:
                    log.info(messages.stopping(stop, self.progress.step))
                if self.save_policy.should_save(self.progress.step, epoch_done=epoch_done, stopping=stop is not None):
                    if epoch_done:
                        self.progress = Progress(self.progress.step, epoch + 1, 0)
                    self.save()
                if stop is not None:
                    progress.close()
                    raise self.stopped(stop, saved=True)
        progress.close()
        steps = self.progress.step - first_step
        if ctx.is_rank_zero:  # the result, on stdout for scripts; everything else the run says is a log on stderr
            print(f"nothing to do: the run in {cfg.output_dir} already finished {self.progress.step} step(s)"
                  if steps == 0 else
                  f"done: {steps} step(s) in {time.perf_counter() - started:.1f} s, final loss {last_loss:.4f}, "
                  f"peak memory {peaks.run_peak_gib():.2f} GiB; checkpoints in {cfg.output_dir}", flush=True)

    def save(self) -> None:
        path = save_checkpoint(
            self.cfg.output_dir,
            model=self.training.model,
            hf_files=hf_model_files(
                self.training.model, base_config=self.base_config, bos_token_id=self.tokenizer.bos_id,
                eos_token_id=self.tokenizer.eos_id,
            ),
            optimizers=self.training.stepper.optimizers_to_checkpoint(),
            state=TrainerState(
                self.progress,
                run_shape(self.cfg, self.run.ctx.world_size, self.training.model, self.run.plan),
                run_hyperparameters(self.cfg),
                self.data.identity,
            ),
            keep_last_n=self.cfg.keep_last_n_checkpoints,
            tokenizer_dir=self.tokenizer_dir,
            chat_template=self.tokenizer.chat_template,
        )
        self.last_checkpoint = path
        log.info("saved checkpoint %s", path)

    def stopped(self, signal_name: str, *, saved: bool):
        return messages.stopped(signal_name, self.progress, self.last_checkpoint, saved=saved,
                                announce=self.run.ctx.is_rank_zero)

    def cleanup(self, *, succeeded: bool) -> None:
        if self.metrics is not None:
            self.metrics.close(succeeded=succeeded)
        if succeeded:
            # After a failure the process group is left alone: other ranks may be waiting in a collective this
            # one will never join, and destroying it under them can hang (NCCL); the process exits right after.
            destroy_distributed(synchronize=True)


def run(cfg: FullFinetuneConfig) -> None:
    """Run the recipe; cleanup always runs (after a success, every rank shuts down together)."""
    recipe = FullFinetuneRecipe(cfg)
    # SIGTERM / Ctrl-C from here on: stop after the current step, with a checkpoint; output_dir is this run's alone
    with (recipe.stop,
          hold_output_dir(cfg.output_dir, init_distributed(cfg.device.value, timeout_s=cfg.distributed_timeout_s))):
        try:
            recipe.setup()
            with logging_redirect_tqdm():
                recipe.train()
        except BaseException:
            recipe.cleanup(succeeded=False)
            raise
        recipe.cleanup(succeeded=True)


if __name__ == "__main__":
    from torchtune_ac.cli import recipe_main

    sys.exit(recipe_main())
