"""A run's process: its context, created once and passed down, and what holds for the run's whole life.

    open_run   join the processes (the one ``init_distributed``), stop signals, output_dir's lock (which creates
               it), the same config and the same output_dir on every rank; cleanup always     -> Run
    plan_run   resolve the run's plan on rank 0 (ac_mode: auto's planner included) and check it against this
               machine and the files, before anything heavy; every rank gets rank 0's plan     -> RunPlan
    log_plan   rank 0 logs the plan (once the data is read: ``RunPlan.with_data``)

A recipe opens the run, builds what is its own (its data), plans, assembles (``assemble.py``) and loops
(``loop.py``), all through the ``Run`` it was given.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator, Optional

import torch
from torch import nn

from torchtune_ac.checkpoint import Progress, check_shared_directory, hold_output_dir
from torchtune_ac.observability.metric_logging import RunLog, plain_config
from torchtune_ac.run import messages
from torchtune_ac.run.checks import check_run
from torchtune_ac.run.plan import RunConfig, RunPlan, resolve_run_plan
from torchtune_ac.runtime.cpu_threads import describe_threads
from torchtune_ac.runtime.distributed import (
    DistributedContext,
    decided_by_rank_zero,
    destroy_distributed,
    init_distributed,
    set_tf32,
)
from torchtune_ac.runtime.process_memory import follow_live_tensors, keep_freed_memory
from torchtune_ac.runtime.rank_agreement import check_same_config
from torchtune_ac.runtime.stop import StopSignals

log = logging.getLogger("torchtune_ac.run")


@dataclass
class Run:
    """One process's run: its context and stop signals, and where training stands (what a stop signal's lines
    say, and what cleanup closes).

    Attributes:
        cfg: the validated config.
        ctx: this process: rank, world size, device (created once, by ``open_run``), and the run's parallelism once
            it is planned (``plan_run``).
        stop: the stop signals (SIGTERM, Ctrl-C), agreed on by every rank once per step.
        progress: where training stands (the loop moves it on).
        last_checkpoint: the newest checkpoint written or resumed from.
        metrics: ``metrics.jsonl`` and the trackers, on rank 0 once opened (closed by cleanup).
        setting_up: what set-up is doing in batches before training (``reference.PASS``), which a stop signal
            ends after its current batch; None otherwise.
    """

    cfg: RunConfig
    ctx: DistributedContext
    stop: StopSignals = field(init=False)
    progress: Progress = field(default_factory=Progress)
    last_checkpoint: Optional[Path] = None
    metrics: Optional[RunLog] = None
    setting_up: Optional[str] = None

    def __post_init__(self) -> None:
        # Rank 0 says at once what a signal will do (the step may take minutes to finish).
        self.stop = StopSignals(
            announce=self.ctx.is_rank_zero,
            requested=lambda name: messages.stop_requested(name, self.progress.step + 1, self.last_checkpoint,
                                                           setting_up=self.setting_up),
            aborted=lambda: messages.aborted(self.progress.step + 1, self.last_checkpoint, setting_up=self.setting_up),
        )

    def close(self, *, succeeded: bool) -> None:
        """Close the metrics; after a success, every rank shuts the process group down together. After a failure
        the process group is left alone: other ranks may be waiting in a collective this one will never join, and
        destroying it under them can hang (NCCL); the process exits right after."""
        if self.metrics is not None:
            self.metrics.close(succeeded=succeeded)
        if succeeded:
            destroy_distributed(synchronize=True)


@contextlib.contextmanager
def open_run(cfg: RunConfig) -> Iterator[Run]:
    """The run of this process, from joining the processes to cleanup (which always runs).

    Joins the process group (its collectives bounded by ``distributed_timeout_s``): the run's one process context.
    On CUDA, float32 matmuls run in TF32 unless ``allow_tf32`` is false. On a CPU with ``ac_mode: auto``, whose
    budget must hold, the allocator gives freed tensors back to the system (``follow_live_tensors``: resident memory
    follows live tensors, as the planner's estimate does); other CPU runs keep what a step frees for the next
    (``keep_freed_memory``), as it is faster. From then on SIGTERM and Ctrl-C stop the run after the current step;
    ``output_dir`` is created and locked, this run's alone; and every rank is checked to have the same config and
    to see the same ``output_dir`` before anything is written there.

    Raises:
        UserError: the device cannot be had, output_dir is locked or cannot be created, the ranks' configs differ,
            or output_dir is not shared.
    """
    ctx = init_distributed(cfg.device.value, timeout_s=cfg.distributed_timeout_s)
    set_tf32(ctx.device, allow_tf32=cfg.allow_tf32)
    if ctx.device.type == "cpu" and cfg.ac.is_auto:
        # Resident memory then follows live tensors, as the planner's estimate does, so the budget holds. It costs
        # every step its page faults (a third of a step on a small model), which only a budget is worth.
        follow_live_tensors()
    elif ctx.device.type == "cpu":
        # Each step reuses the blocks the last one freed: no page faults, the same peak (runtime/process_memory.py).
        keep_freed_memory()
    logging.basicConfig(level=logging.INFO if ctx.is_rank_zero else logging.WARNING, format="%(message)s")
    run = Run(cfg, ctx)
    with run.stop, hold_output_dir(cfg.output_dir, ctx) as release_lock:
        run.stop.before_abort = release_lock  # a second Ctrl-C ends the process at once, but not holding the lock
        try:
            check_same_config(plain_config(cfg), ctx)
            check_shared_directory(cfg.output_dir, "output_dir", ctx)
            ctx.barrier()  # every rank has checked output_dir before rank 0 writes to it
            yield run
        except BaseException:
            run.close(succeeded=False)
            raise
        run.close(succeeded=True)


def plan_run(run: Run, model: nn.Module, *, tokenizer: Any) -> RunPlan:
    """The run's plan, resolved and checked once, by rank 0, before anything heavy, and applied by every rank (see the
    module docstring); rank 0 logs what it found worth a warning. The process context takes the plan's parallelism
    (which share of the data each rank reads). Its steps are counted once the data is read
    (``RunPlan.with_data``).

    Args:
        run: this process's run.
        model: the model, built once on the meta device.
        tokenizer: the run's tokenizer (checked against the model's vocabulary).

    Raises:
        UserError: on every rank, the first problem rank 0 found.
    """
    cfg, ctx = run.cfg, run.ctx

    def resolve() -> tuple[RunPlan, list[str]]:
        plan = resolve_run_plan(cfg, model, world_size=ctx.world_size, device=ctx.device)
        return plan, check_run(cfg, plan, model, strict=True, tokenizer=tokenizer).warnings

    plan, warnings = decided_by_rank_zero(ctx, resolve)
    run.ctx = dataclasses.replace(ctx, parallelism=plan.parallelism)
    if ctx.is_rank_zero:
        for warning in (*plan.notes, *warnings):
            log.warning(warning)
    return plan


def log_plan(run: Run, plan: RunPlan) -> None:
    """Rank 0 logs the plan as ``tune validate`` prints it, one ``label: value`` line each."""
    if not run.ctx.is_rank_zero:
        return
    log.info("world size %d on %s (%s), %d thread(s) per process", run.ctx.world_size, run.ctx.device,
             plan.dtype.value, torch.get_num_threads())
    log.info("CPU threads: %s", describe_threads())
    for label, value in plan.describe():
        log.info("%s: %s", label, value)
    for warning in messages.length_warnings(plan.length, plan.hyperparameters):
        log.warning(warning)
