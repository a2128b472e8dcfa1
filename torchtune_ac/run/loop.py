"""The training loop every recipe shares: epochs and steps from the plan, the step (the objective's loss over every
micro-batch, then the stepper's update), the learning-rate schedule, validation, ``metrics.jsonl`` and the
trackers, the progress bar, checkpoints as the plan's save policy says, stop signals (agreed on by every rank after
each step) and the stop on a non-finite loss.

What is a recipe's own comes in with the assembled model: its objective (``AssembledModel.objective``), whose metrics
are logged beside the loss (``StepResult.extra``) and, on validation, as ``val_loss`` and ``val_<metric>``. SIGTERM
or a first Ctrl-C stops the run after the current step with a checkpoint (exit 143); a non-finite loss or gradient
norm stops it before the optimizer takes it in, saving nothing (exit 3).
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any, Iterable, Mapping, Optional, Sequence

import torch

from torchtune_ac.checkpoint import Progress, RecipeState, read_hf_config, save_checkpoint
from torchtune_ac.errors import RunStopped
from torchtune_ac.lora.export import adapter_files, merged_model_files
from torchtune_ac.memory.planner.workload import ROUTED_ROWS_MARGIN
from torchtune_ac.models import hf_model_files
from torchtune_ac.observability.metric_logging import open_run_log
from torchtune_ac.observability.metrics import MemoryPeaks
from torchtune_ac.observability.progress import ProgressReporter
from torchtune_ac.parallel.expert_parallel import busiest_rank_load
from torchtune_ac.run import messages
from torchtune_ac.run.assemble import AssembledModel
from torchtune_ac.run.phases import RunData, ValidationData
from torchtune_ac.run.plan import RunPlan
from torchtune_ac.run.session import Run
from torchtune_ac.runtime.non_finite import NonFiniteError
from torchtune_ac.training.evaluation import Evaluation, evaluate_objective
from torchtune_ac.training.step import StepResult, move_batch, train_step

log = logging.getLogger("torchtune_ac.run")
Batch = Mapping[str, torch.Tensor]


class TrainingLoop:
    """Runs the loop of one process (see the module docstring).

    Args:
        run: this process's run (context, stop signals, progress, metrics).
        plan: the run's plan (its length, its save policy, what a resume keeps).
        training: the model, its stepper and scheduler, and the objective.
        data: this rank's loader.
        tokenizer: the run's tokenizer (its files and ids are saved with every checkpoint).
        validation: the held-out data, or None.
    """

    def __init__(self, run: Run, plan: RunPlan, training: AssembledModel, data: RunData, *, tokenizer: Any,
                 validation: Optional[ValidationData] = None) -> None:
        self.run, self.plan, self.training, self.data = run, plan, training, data
        self.tokenizer, self.validation = tokenizer, validation
        self.tokenizer_dir = Path(tokenizer.path).parent  # its files go into every checkpoint
        self.warned_expert_load = False  # a layer past the planner's routed-rows margin, warned once a run
        # The saved config.json keeps every key of the one the run started from that training did not change.
        self.base_config = read_hf_config(plan.checkpoint_dir) if plan.checkpoint_dir is not None else None

    def open_metrics(self) -> None:
        """``metrics.jsonl`` and the tracker, on rank 0; a resume drops what the interrupted run logged after its
        checkpoint (all of it without one)."""
        run = self.run
        if not run.ctx.is_rank_zero:
            return
        cfg = run.cfg
        tracker = cfg.metric_logger.instantiate() if cfg.metric_logger is not None else None
        run.metrics = open_run_log(cfg.output_dir, tracker, config=cfg,
                                   resume_after_step=run.progress.step if cfg.resume_from_checkpoint else None)

    def step(self, micro_batches: Sequence[Batch]) -> StepResult:
        """One optimizer step: the objective's loss of every micro-batch, then the stepper's update."""
        training = self.training
        return train_step(training.model, training.stepper, micro_batches, ctx=self.run.ctx,
                          objective=training.objective, clip_grad_norm=self.run.cfg.clip_grad_norm)

    def evaluate(self, batches: Iterable[Batch]) -> Evaluation:
        """The objective's validation loss and metrics over the held-out batches."""
        return evaluate_objective(self.training.model, batches, ctx=self.run.ctx, objective=self.training.objective)

    def train(self) -> None:
        """Every remaining step of the run; ends with a checkpoint at each epoch's end, or raises ``RunStopped``."""
        run, ctx, length = self.run, self.run.ctx, self.plan.length
        # A bar on a terminal; plain lines every log_every_n_steps in a log file (no carriage returns).
        progress = ProgressReporter(total=length.total_steps, initial=run.progress.step,
                                    every=run.cfg.log_every_n_steps, enabled=ctx.is_rank_zero)
        started, first_step = time.perf_counter(), run.progress.step
        peaks = MemoryPeaks(ctx.device)  # each logged line: the peaks since the line before
        if (stop := run.stop.agreed(ctx)) is not None:  # a signal during set-up: nothing new to save
            raise self.stopped(stop, saved=False)
        last_loss = float("nan")
        for epoch in range(run.progress.epoch, length.epochs):
            for step_in_epoch, micro in self.epoch_batches(epoch):
                step_start = time.perf_counter()
                result, lr = self.optimizer_step(micro)
                elapsed = time.perf_counter() - step_start
                run.progress = Progress(run.progress.step + 1, epoch, step_in_epoch + 1)
                last_loss = result.loss
                epoch_done = step_in_epoch + 1 == length.steps_per_epoch
                validated = self.validate_if_due(epoch_done)
                self.log_step(result, lr, elapsed, epoch, validated, peaks, progress)
                stop = run.stop.agreed(ctx)  # every rank stops after the same step
                if stop is not None:
                    log.info(messages.stopping(stop, run.progress.step))
                if self.plan.save.should_save(run.progress.step, epoch_done=epoch_done, stopping=stop is not None):
                    if epoch_done:
                        run.progress = Progress(run.progress.step, epoch + 1, 0)
                    self.save()
                if stop is not None:
                    progress.close()
                    raise self.stopped(stop, saved=True)
        progress.close()
        steps = run.progress.step - first_step
        if ctx.is_rank_zero:  # the result, on stdout for scripts; everything else the run says is a log on stderr
            print(messages.nothing_to_do(run.cfg.output_dir, run.progress.step) if steps == 0 else
                  f"done: {steps} step(s) in {time.perf_counter() - started:.1f} s, final loss {last_loss:.4f}, "
                  f"peak memory {peaks.run_peak_gib():.2f} GiB; checkpoints in {run.cfg.output_dir}", flush=True)

    def epoch_batches(self, epoch: int) -> Iterable[tuple[int, list[Batch]]]:
        """This epoch's remaining steps (a resume skips what it had done), each with its micro-batches on the
        device."""
        run, data, length = self.run, self.data, self.plan.length
        accum = length.gradient_accumulation_steps
        data.loader.set_epoch(epoch)
        skip = run.progress.step_in_epoch if epoch == run.progress.epoch else 0
        data.loader.skip_steps(skip * accum)
        batches = iter(data.loader)
        for step_in_epoch in range(skip, length.steps_per_epoch):
            yield step_in_epoch, [move_batch(next(batches), run.ctx.device) for _ in range(accum)]

    def optimizer_step(self, micro: list[Batch]) -> tuple[StepResult, float]:
        """One step and the schedule's; returns its result and the learning rate it stepped with.

        Raises:
            RunStopped: the loss or the gradient norm was not finite (exit 3; nothing saved).
        """
        run, training = self.run, self.training
        try:
            result = self.step(micro)
        except NonFiniteError as err:
            raise messages.diverged(err, run.progress, run.last_checkpoint, announce=run.ctx.is_rank_zero) from None
        # A float now: torchao's optimizers keep the learning rate in a tensor the scheduler updates in place.
        lr = float(training.stepper.optimizer.param_groups[0]["lr"])
        if training.scheduler is not None:
            training.scheduler.step()
        return result, lr

    def validate_if_due(self, epoch_done: bool) -> dict[str, float]:
        """The validation loss and metrics after the step just finished, when it is one to validate after
        (``val_loss``, ``val_<metric>``); empty otherwise."""
        step = self.run.progress.step
        if self.validation is None or not self.validation.due(step, epoch_done=epoch_done):
            return {}
        evaluation = self.evaluate(self.validation.batches())
        validated = {"val_loss": evaluation.loss, **{f"val_{k}": v for k, v in evaluation.metrics.items()}}
        log.info("step %d: validation %s", step, ", ".join(f"{k[4:]} {v:.4f}" for k, v in validated.items()))
        return validated

    def log_step(self, result: StepResult, lr: float, elapsed: float, epoch: int, validated: dict[str, float],
                 peaks: MemoryPeaks, progress: ProgressReporter) -> None:
        """The step's line in ``metrics.jsonl`` (every log_every_n_steps-th step, each validated one, and the run's
        last, whatever the period) and in the progress bar."""
        run = self.run
        step = run.progress.step
        tokens_per_second = result.input_tokens / elapsed
        target_tokens_per_second = result.target_tokens / elapsed
        val_loss = validated.get("val_loss")
        logged = step % run.cfg.log_every_n_steps == 0 or val_loss is not None or step == self.plan.length.total_steps
        if run.metrics is not None and logged:
            run.metrics.write(
                {
                    "step": step,
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
                    **validated,
                    **result.extra,
                    **result.counts,
                    **self.expert_load(result.counts),
                }
            )
        progress.update(step=step, loss=result.loss, lr=lr, tokens_per_second=tokens_per_second,
                        target_tokens_per_second=target_tokens_per_second, val_loss=val_loss, extra=result.extra)

    def expert_load(self, counts: Mapping[str, Any]) -> dict[str, list[float]]:
        """Under expert parallelism, ``moe_ep_rank_load``: per MoE layer, the busiest process's received rows against
        the mean (``busiest_rank_load``), with a warning, once a run, when a layer passes the margin the memory
        planner sized the experts' buffers for."""
        degree = self.plan.parallelism.expert
        if degree <= 1 or "moe_expert_tokens" not in counts:
            return {}
        loads = busiest_rank_load(counts["moe_expert_tokens"], degree)
        if max(loads) > ROUTED_ROWS_MARGIN and not self.warned_expert_load:
            self.warned_expert_load = True
            layer = loads.index(max(loads))
            log.warning("step %d: MoE layer %d's busiest expert-parallel process received %.2fx the mean of its "
                        "group's rows, past the %.1fx tune plan assumed: its memory estimate may be low "
                        "(moe_ep_rank_load in metrics.jsonl)", self.run.progress.step, layer, loads[layer],
                        ROUTED_ROWS_MARGIN)
        return {"moe_ep_rank_load": loads}

    def save(self) -> Path:
        """A checkpoint of the current step (every rank takes part): the model as a Hugging Face checkpoint with the
        tokenizer's files, and the recipe state a resume continues from (what the run's plan says a resume keeps,
        the hyper-parameters and the data's identity)."""
        run, model, tokenizer, adapter = self.run, self.training.model, self.tokenizer, self.plan.adapter
        token_ids = {"bos_token_id": tokenizer.bos_id, "eos_token_id": tokenizer.eos_id}
        # With adapters: they alone, as a PEFT folder, and the merged model in merged/ when asked
        # (``torchtune_ac/lora/``).
        hf_files = hf_model_files(model, base_config=self.base_config, **token_ids) if adapter is None else None
        merged_files = (merged_model_files(model, base_config=self.base_config, **token_ids)
                        if adapter is not None and adapter.save_merged else None)
        path = save_checkpoint(
            run.cfg.output_dir,
            model=model,
            hf_files=hf_files,
            adapter_files=(None if adapter is None
                           else adapter_files(model, adapter, base_model=self.plan.checkpoint_dir)),
            merged_files=merged_files,
            optimizers=self.training.stepper.optimizers_to_checkpoint(),
            state=RecipeState(run.progress, self.plan.resume_shape(), dict(self.plan.hyperparameters),
                               self.data.identity),
            keep_last_n=self.plan.save.keep_last_n,
            tokenizer_dir=self.tokenizer_dir,
            chat_template=tokenizer.chat_template,
            processes=run.ctx,
        )
        run.last_checkpoint = path
        log.info("saved checkpoint %s", path)
        return path

    def stopped(self, signal_name: str, *, saved: bool) -> RunStopped:
        return messages.stopped(signal_name, self.run.progress, self.run.last_checkpoint, saved=saved,
                                announce=self.run.ctx.is_rank_zero)
