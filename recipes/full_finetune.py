"""Full fine-tuning of a Llama-style model: one device, or N processes sharded with FSDP2.

    tune run full_finetune --config tiny/full
    tune run --nproc_per_node 2 full_finetune --config tiny/full

The recipe only orders library calls: setup -> train (train_step, save_checkpoint) -> cleanup (always).
Everything it calls lives in torchtune_ac, so another recipe reuses it rather than copying it.

SIGTERM or a first Ctrl-C stops the run after the current step with a checkpoint (exit 143); a non-finite loss
or gradient norm stops it before the optimizer takes it in, saving nothing (exit 3).
"""

from __future__ import annotations

import logging
import sys
import time
from pathlib import Path
from typing import Optional

import torch
from tqdm.contrib.logging import logging_redirect_tqdm

from torchtune_ac.checkpoint import (
    Progress,
    ResumeChoice,
    check_resume_shape,
    check_shared_directory,
    choose_resume_checkpoint,
    create_output_dir,
    hold_output_dir,
    load_checkpoint,
    read_trainer_state,
    save_checkpoint,
)
from torchtune_ac.config.preflight import preflight_full_finetune, run_shape
from torchtune_ac.config.schema import FullFinetuneConfig
from torchtune_ac.data import build_dataloader
from torchtune_ac.errors import EXIT_NON_FINITE, EXIT_STOPPED, RunStopped, UserError
from torchtune_ac.training.distributed import barrier, destroy_distributed, init_distributed
from torchtune_ac.training.metric_logging import RunLog, open_run_log, plain_config
from torchtune_ac.training.metrics import peak_memory_gib
from torchtune_ac.training.model_setup import build_training_model
from torchtune_ac.training.non_finite import NonFiniteError
from torchtune_ac.training.optimizer_in_backward import build_optimizer, optimizers_to_checkpoint
from torchtune_ac.training.progress import ProgressReporter
from torchtune_ac.training.rank_agreement import check_same_config
from torchtune_ac.training.step import move_batch, train_step
from torchtune_ac.training.stop import StopSignals

CONFIG_SCHEMA = FullFinetuneConfig
log = logging.getLogger("torchtune_ac.full_finetune")


def preflight(cfg: FullFinetuneConfig, *, strict: bool = True, world_size: Optional[int] = 1) -> list[tuple[str, str]]:
    """Start-up checks and summary (``tune validate`` calls this with ``strict=False``; the launcher with the
    world size it is about to start, or None when it cannot tell)."""
    report = preflight_full_finetune(cfg, strict=strict, world_size=world_size)
    return report.summary + [("warning", w) for w in report.warnings]


class FullFinetuneRecipe:
    def __init__(self, cfg: FullFinetuneConfig) -> None:
        self.cfg = cfg
        self.metrics: Optional[RunLog] = None
        self.stop = StopSignals()
        self.last_checkpoint: Optional[Path] = None

    def setup(self) -> None:
        cfg = self.cfg
        self.ctx = ctx = init_distributed(cfg.device.value)
        logging.basicConfig(level=logging.INFO if ctx.is_rank_zero else logging.WARNING, format="%(message)s")
        report = preflight_full_finetune(cfg, strict=True, world_size=ctx.world_size)
        for warning in report.warnings:
            log.warning(warning)
        # Before anything is written: every rank has the same config and sees the same output_dir.
        check_same_config(plain_config(cfg), ctx)
        check_shared_directory(cfg.output_dir, "output_dir")
        barrier(ctx)  # every rank has checked output_dir before rank 0 writes to it
        resume = (choose_resume_checkpoint(cfg.output_dir, hashes=True, collective=True)
                  if cfg.resume_from_checkpoint else ResumeChoice(None))
        for skipped in resume.skipped:
            log.warning("resume: %s", skipped)
        resume_from = resume.checkpoint
        torch.manual_seed(cfg.seed)

        self.tokenizer = cfg.tokenizer.instantiate()
        self.plan = report.plan
        self.model = build_training_model(
            cfg.model,
            ctx=ctx,
            dtype=cfg.dtype,
            ac=self.plan.ac,
            fsdp=cfg.fsdp,
            compile_blocks=cfg.compile,
            checkpoint_dir=cfg.checkpoint_dir,
            load_weights=resume_from is None,  # a resume loads them from its recipe state
            seed=cfg.seed,
        )
        self.optimizer = build_optimizer(cfg.optimizer.instantiate, self.model, in_backward=self.plan.optimizer_in_backward)

        dataset = cfg.dataset.instantiate(self.tokenizer, max_seq_len=cfg.max_seq_len)
        self.loader = build_dataloader(
            dataset,
            batch_size=cfg.batch_size,
            rank=ctx.rank,
            world_size=ctx.world_size,
            shuffle=cfg.shuffle,
            seed=cfg.seed,
            pad_id=self.tokenizer.pad_id,
        )
        batches_per_epoch = len(self.loader)
        self.steps_per_epoch = batches_per_epoch // cfg.gradient_accumulation_steps
        if cfg.max_steps_per_epoch is not None:
            self.steps_per_epoch = min(self.steps_per_epoch, cfg.max_steps_per_epoch)
        if self.steps_per_epoch == 0:
            raise UserError(
                f"dataset: {len(dataset)} samples make {batches_per_epoch} batch(es) per process per epoch, fewer than "
                f"gradient_accumulation_steps={cfg.gradient_accumulation_steps} (reduce batch_size or accumulation)"
            )
        self.total_steps = self.steps_per_epoch * cfg.epochs
        self.scheduler = (
            cfg.lr_scheduler.instantiate(self.optimizer, num_training_steps=self.total_steps)
            if cfg.lr_scheduler is not None
            else None
        )

        self.progress = Progress()
        if resume_from is not None:
            saved_progress, saved_shape = read_trainer_state(resume_from)
            check_resume_shape(resume_from, saved_shape, run_shape(cfg, ctx.world_size, self.model))
            if saved_progress.epoch >= cfg.epochs and saved_progress.step < self.total_steps:
                # A finished epoch is not reopened: more steps per epoch would otherwise end in "nothing to do".
                raise UserError(
                    f"resume from {resume_from}: the run finished its {saved_progress.epoch} epoch(s) at step "
                    f"{saved_progress.step}, but this config makes {self.steps_per_epoch} steps per epoch "
                    f"({self.total_steps} in all: max_steps_per_epoch or the data changed); finished epochs are not "
                    "extended: raise epochs to train more, or start a new run in another output_dir"
                )
            load_checkpoint(resume_from, model=self.model, optimizers=optimizers_to_checkpoint(self.optimizer),
                            scheduler=self.scheduler)
            self.progress, self.last_checkpoint = saved_progress, resume_from
            log.info("resumed from %s at step %d", resume_from, self.progress.step)
            if saved_shape.world_size != ctx.world_size:
                log.info("resharded from %d process(es) to %d: model, optimizer, scheduler and data order carry "
                         "over; dropout masks do not (each rank's RNG state is its own)",
                         saved_shape.world_size, ctx.world_size)
        elif cfg.resume_from_checkpoint:
            log.info("resume_from_checkpoint=true: %s holds no checkpoint yet, so the run starts at step 0",
                     cfg.output_dir)
        if ctx.is_rank_zero:
            create_output_dir(cfg.output_dir)
            tracker = cfg.metric_logger.instantiate() if cfg.metric_logger is not None else None
            # A resume drops what the interrupted run logged after its checkpoint (all of it without one).
            self.metrics = open_run_log(cfg.output_dir, tracker, config=cfg,
                                        resume_after_step=self.progress.step if cfg.resume_from_checkpoint else None)

        global_batch = cfg.batch_size * cfg.gradient_accumulation_steps * ctx.world_size
        for line in (
            f"world size {ctx.world_size} on {ctx.device} ({cfg.dtype.value})",
            f"model {cfg.model.path}: {report.n_parameters:,} parameters, {self.plan.ac.n_layers} layers",
            *(f"{label}: {value}" for label, value in self.plan.describe()),
            f"global batch {global_batch} samples ({cfg.batch_size} x {cfg.gradient_accumulation_steps} accumulation"
            f" x {ctx.world_size} processes); {len(dataset)} samples, {self.steps_per_epoch} steps per epoch,"
            f" {cfg.epochs} epoch(s)",
        ):
            log.info(line)

    def train(self) -> None:
        cfg, ctx = self.cfg, self.ctx
        accum = cfg.gradient_accumulation_steps
        # A bar on a terminal; plain lines every log_every_n_steps in a log file (no carriage returns).
        progress = ProgressReporter(total=self.total_steps, initial=self.progress.step, every=cfg.log_every_n_steps,
                                    enabled=ctx.is_rank_zero)
        started = time.perf_counter()
        first_step, last_loss = self.progress.step, float("nan")
        if (stop := self.stop.agreed(ctx)) is not None:  # a signal during set-up: nothing new to save
            raise self.stopped(stop, saved=False)
        for epoch in range(self.progress.epoch, cfg.epochs):
            self.loader.set_epoch(epoch)
            skip = self.progress.step_in_epoch if epoch == self.progress.epoch else 0
            self.loader.skip_steps(skip * accum)
            batches = iter(self.loader)
            for step_in_epoch in range(skip, self.steps_per_epoch):
                step_start = time.perf_counter()
                micro = [move_batch(next(batches), ctx.device) for _ in range(accum)]
                try:
                    result = train_step(self.model, self.optimizer, micro, ctx=ctx,
                                        clip_grad_norm=cfg.clip_grad_norm, loss_chunks=self.plan.loss_chunks)
                except NonFiniteError as err:
                    raise self.diverged(err) from None
                lr = self.optimizer.param_groups[0]["lr"]
                if self.scheduler is not None:
                    self.scheduler.step()
                elapsed = time.perf_counter() - step_start
                self.progress = Progress(self.progress.step + 1, epoch, step_in_epoch + 1)
                last_loss = result.loss
                tokens_per_second = result.input_tokens / elapsed
                target_tokens_per_second = result.target_tokens / elapsed
                if self.metrics is not None and self.progress.step % cfg.log_every_n_steps == 0:
                    self.metrics.write(
                        {
                            "step": self.progress.step,
                            "epoch": epoch,
                            "loss": result.loss,
                            "lr": lr,
                            "grad_norm": result.grad_norm,
                            "tokens_per_second": tokens_per_second,
                            "peak_memory_gib": peak_memory_gib(ctx.device),
                            "tokens": result.input_tokens,
                            "target_tokens": result.target_tokens,
                            "step_time_s": elapsed,
                            "target_tokens_per_second": target_tokens_per_second,
                        }
                    )
                progress.update(step=self.progress.step, loss=result.loss, lr=lr, tokens_per_second=tokens_per_second,
                                target_tokens_per_second=target_tokens_per_second)
                stop = self.stop.agreed(ctx)  # every rank stops after the same step
                if stop is not None:
                    log.info("%s received: saving step %d, then stopping (Ctrl-C again aborts at once)",
                             stop, self.progress.step)
                epoch_done = step_in_epoch + 1 == self.steps_per_epoch
                if epoch_done or stop or (cfg.save_every_n_steps and self.progress.step % cfg.save_every_n_steps == 0):
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
                  f"peak memory {peak_memory_gib(ctx.device):.2f} GiB; checkpoints in {cfg.output_dir}", flush=True)

    def save(self) -> None:
        path = save_checkpoint(
            self.cfg.output_dir,
            model=self.model,
            optimizers=optimizers_to_checkpoint(self.optimizer),
            scheduler=self.scheduler,
            progress=self.progress,
            shape=run_shape(self.cfg, self.ctx.world_size, self.model),
            keep_last_n=self.cfg.keep_last_n_checkpoints,
            tokenizer_dir=Path(self.tokenizer.path).parent,
            chat_template=self.tokenizer.chat_template,
            base_checkpoint_dir=self.cfg.checkpoint_dir,
            hf_config_extra={"bos_token_id": self.tokenizer.bos_id, "eos_token_id": self.tokenizer.eos_id},
        )
        self.last_checkpoint = path
        log.info("saved checkpoint %s", path)

    def stopped(self, signal_name: str, *, saved: bool) -> RunStopped:
        """The stop on a signal, after the checkpoint of the current step (``saved``) or before any step."""
        if saved:
            what = f"after step {self.progress.step}: checkpoint {self.last_checkpoint} written"
        else:
            since = self.last_checkpoint.name if self.last_checkpoint else "the start (no step taken yet)"
            what = f"before step {self.progress.step + 1}: nothing new to save since {since}"
        return RunStopped(f"stopped by {signal_name} {what}; to continue, run the same command with "
                          "resume_from_checkpoint=true", exit_status=EXIT_STOPPED, announce=self.ctx.is_rank_zero)

    def diverged(self, err: NonFiniteError) -> RunStopped:
        """The stop on a non-finite loss or gradient norm: nothing is saved, the newest checkpoint predates it."""
        newest = (f"the newest checkpoint is still {self.last_checkpoint}" if self.last_checkpoint
                  else "there is no checkpoint yet")
        taken = ("with optimizer_in_bwd the parameters were stepped in backward, in memory only"
                 if err.stepped else "no optimizer step took it in")
        return RunStopped(f"stopped at step {self.progress.step + 1}: {err.describe()}; {taken}, and nothing was saved "
                          f"({newest}): lower the learning rate or check that step's data, then resume with "
                          "resume_from_checkpoint=true", exit_status=EXIT_NON_FINITE, announce=self.ctx.is_rank_zero)

    def cleanup(self, *, succeeded: bool) -> None:
        if self.metrics is not None:
            self.metrics.close(succeeded=succeeded)
        destroy_distributed(synchronize=succeeded)


def run(cfg: FullFinetuneConfig) -> None:
    """Run the recipe; cleanup always runs (after a success, every rank shuts down together)."""
    recipe = FullFinetuneRecipe(cfg)
    # SIGTERM / Ctrl-C from here on: stop after the current step, with a checkpoint; output_dir is this run's alone
    with recipe.stop, hold_output_dir(cfg.output_dir, init_distributed(cfg.device.value)):
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
