"""The set-up phases of a fine-tuning run, each a function that returns a typed value. A recipe calls them in
order (``recipes/full_finetune.py``); another recipe composes the same ones.

    start_run        join the processes, check the config once, agree on it and on output_dir -> RunContext
    choose_resume    the checkpoint to continue from (resume_from_checkpoint)                 -> ResumeChoice
    build_model      build -> memory switches -> shard -> load, and who steps the parameters  -> TrainingModel
    build_data       the data loader, its steps per epoch and the run's length                -> RunData
    build_validation the held-out data of the validation loss, and when to compute it     -> ValidationData
    restore          a resume's progress, model and optimizer state; this config's hyper-parameters -> Progress
    SavePolicy       when a step ends with a checkpoint
    check_disk_space before the first step: room for one checkpoint (refused), for those kept (warned)
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator, Optional

import torch
from torch import nn

from torchtune_ac.checkpoint import (
    RESUMABLE_KEPT,
    TOKENIZER_FILES,
    Progress,
    ResumeChoice,
    agreed_free_bytes,
    check_resume_shape,
    check_shared_directory,
    choose_resume_checkpoint,
    describe_data_change,
    identify_data,
    load_checkpoint,
    read_trainer_state,
)
from torchtune_ac.config.preflight import PreflightReport, preflight_full_finetune, run_hyperparameters, run_shape
from torchtune_ac.config.schema import FullFinetuneConfig
from torchtune_ac.data import build_dataloader
from torchtune_ac.data.collate import COMPILED_LENGTH_MULTIPLE
from torchtune_ac.data.sampler import evaluation_batches
from torchtune_ac.data.samples import count_of, describe_samples
from torchtune_ac.errors import UserError
from torchtune_ac.memory.optimizer_state import layout_of, state_bytes
from torchtune_ac.memory.plan import MemoryPlan
from torchtune_ac.observability.metric_logging import plain_config
from torchtune_ac.run.messages import (
    data_changed,
    disk_may_fill,
    disk_too_small,
    finished_epochs_not_extended,
    hyperparameter_changes,
    hyperparameters_changed,
    resharded,
)
from torchtune_ac.run.model_setup import build_training_model
from torchtune_ac.runtime.distributed import DistributedContext, barrier, init_distributed, set_tf32
from torchtune_ac.runtime.process_memory import follow_live_tensors
from torchtune_ac.runtime.rank_agreement import check_same_config
from torchtune_ac.training.objective import Objective
from torchtune_ac.training.step import Stepper

log = logging.getLogger("torchtune_ac.run")


@dataclass(frozen=True)
class RunContext:
    """One process's view of the run: its rank and device, and the config's checks and memory plan.

    Attributes:
        ctx: rank, world size and device.
        report: the start-up checks' findings (summary, warnings, parameter count).
        plan: the resolved memory plan.
    """

    ctx: DistributedContext
    report: PreflightReport
    plan: MemoryPlan


def start_run(cfg: FullFinetuneConfig) -> RunContext:
    """Join the process group (its collectives bounded by ``distributed_timeout_s``), run the start-up checks
    (their warnings are logged), and make sure every rank has the same config and sees the same ``output_dir``
    before anything is written. On CUDA, float32 matmuls run in TF32 unless ``allow_tf32`` is false. On a CPU with
    ``ac_mode: auto``, whose budget must hold, the allocator is set to give freed tensors back to the system
    (``follow_live_tensors``); other runs leave it alone, as it is faster.

    Raises:
        UserError: a check failed, the ranks' configs differ, or ``output_dir`` is not shared.
    """
    ctx = init_distributed(cfg.device.value, timeout_s=cfg.distributed_timeout_s)
    set_tf32(ctx.device, allow_tf32=cfg.allow_tf32)
    if ctx.device.type == "cpu" and cfg.ac.is_auto:
        # Resident memory then follows live tensors, as the planner's estimate does, so the budget holds. It costs
        # every step its page faults (a third of a step on a small model), which only a budget is worth.
        follow_live_tensors()
    logging.basicConfig(level=logging.INFO if ctx.is_rank_zero else logging.WARNING, format="%(message)s")
    report = preflight_full_finetune(cfg, strict=True, world_size=ctx.world_size)
    for warning in report.warnings:
        log.warning(warning)
    check_same_config(plain_config(cfg), ctx)
    check_shared_directory(cfg.output_dir, "output_dir")
    barrier(ctx)  # every rank has checked output_dir before rank 0 writes to it
    return RunContext(ctx, report, report.plan)


def choose_resume(cfg: FullFinetuneConfig) -> ResumeChoice:
    """The checkpoint a resume continues from (every file's hash checked, the same answer on every rank); no
    checkpoint when ``resume_from_checkpoint`` is false. Newer checkpoints that were skipped are logged."""
    if not cfg.resume_from_checkpoint:
        return ResumeChoice(None)
    choice = choose_resume_checkpoint(cfg.output_dir, hashes=True, collective=True)
    for skipped in choice.skipped:
        log.warning("resume: %s", skipped)
    return choice


@dataclass
class TrainingModel:
    """The model to train and what steps it.

    Attributes:
        model: on the run's device, sharded when there are several processes, in training mode.
        stepper: who steps the parameters (``stepper.optimizer`` is what an LR scheduler drives).
        objective: what each micro-batch's loss is.
    """

    model: nn.Module
    stepper: Stepper
    objective: Objective


def build_model(cfg: FullFinetuneConfig, run: RunContext, *, load_weights: bool) -> TrainingModel:
    """Build the model in the one working order, with the memory plan's switches applied, and its stepper.

    Args:
        cfg: the run's config.
        run: the run context (device, world size, memory plan).
        load_weights: fill the weights from ``checkpoint_dir`` or the seed; False when a resume loads them.
    """
    torch.manual_seed(cfg.seed)
    model = build_training_model(
        cfg.model,
        ctx=run.ctx,
        dtype=cfg.dtype,
        memory=run.plan,
        fsdp=cfg.fsdp,
        compile_blocks=cfg.compile,
        checkpoint_dir=cfg.checkpoint_dir,
        load_weights=load_weights,
        seed=cfg.seed,
    )
    stepper = run.plan.build_stepper(cfg.optimizer.instantiate, model)
    return TrainingModel(model, stepper, run.plan.objective())


@dataclass
class RunData:
    """The data of a run.

    Attributes:
        loader: this rank's batches (``set_epoch``, ``skip_steps``).
        samples: samples in the dataset (rows, when packed).
        steps_per_epoch: optimizer steps per epoch (after ``max_steps_per_epoch``).
        total_steps: optimizer steps of the whole run.
        identity: what identifies the data (each file's size and SHA-256, the sample count), which a checkpoint
            records and a resume checks (``checkpoint.identify_data``).
        described: what the dataset holds, for the start-up log: ``3,000 samples``, or for a packed one
            ``packed: 3,000 samples -> 412 rows of 256 tokens, 93.1 % filled``.
        unit: what one of ``samples`` is: ``sample``, or ``row`` when packed.
    """

    loader: Any
    samples: int
    steps_per_epoch: int
    total_steps: int
    identity: dict[str, Any]
    described: str = ""
    unit: str = "sample"


def batch_padding(cfg: FullFinetuneConfig) -> dict[str, Any]:
    """How batches are padded: compiled blocks get lengths that repeat (multiples of ``COMPILED_LENGTH_MULTIPLE``,
    at most ``max_seq_len``), so that they are not recompiled for each new length; eager ones, the longest
    sample's."""
    if not cfg.compile:
        return {"pad_to_multiple_of": 1}
    return {"pad_to_multiple_of": COMPILED_LENGTH_MULTIPLE, "max_length": cfg.max_seq_len}


def build_data(cfg: FullFinetuneConfig, tokenizer: Any, ctx: DistributedContext) -> RunData:
    """The dataset, this rank's loader (batches in pinned memory for a CUDA run, so that their copy to the GPU is
    asynchronous; padded as ``batch_padding`` says), the run's length in optimizer steps, and what identifies the
    data (its files hashed once, the ranks sharing the reading).

    Raises:
        UserError: the dataset has fewer batches per process than one optimizer step needs.
    """
    dataset = cfg.dataset.instantiate(tokenizer, max_seq_len=cfg.max_seq_len)
    loader = build_dataloader(dataset, batch_size=cfg.batch_size, rank=ctx.rank, world_size=ctx.world_size,
                              shuffle=cfg.shuffle, seed=cfg.seed, pad_id=tokenizer.pad_id,
                              **batch_padding(cfg), pin_memory=ctx.device.type == "cuda")
    batches_per_epoch = len(loader)
    steps_per_epoch = batches_per_epoch // cfg.gradient_accumulation_steps
    if cfg.max_steps_per_epoch is not None:
        steps_per_epoch = min(steps_per_epoch, cfg.max_steps_per_epoch)
    if steps_per_epoch == 0:
        raise UserError(
            f"dataset: {describe_samples(dataset)} make {batches_per_epoch} batch(es) per process per epoch, fewer "
            f"than gradient_accumulation_steps={cfg.gradient_accumulation_steps} (reduce batch_size or accumulation)"
        )
    files = dataset.source_files
    identity = identify_data(dataset.source, files and files.root, files and files.names, len(dataset),
                             collective=ctx.is_distributed, hub=files.hub if files else ())
    unit = "row" if getattr(dataset, "packing", None) is not None else "sample"
    return RunData(loader, len(dataset), steps_per_epoch, steps_per_epoch * cfg.epochs, identity,
                   describe_samples(dataset), unit)


@dataclass
class ValidationData:
    """The held-out data of the validation loss, and when to compute it.

    Attributes:
        dataset: the ``dataset_val`` samples.
        batch_size: samples per process per batch.
        every_n_steps: validate every this many optimizer steps; None: at the end of each epoch.
        pad_id: the tokenizer's padding id.
        ctx: this rank's place in the run.
        padding: how batches are padded (``batch_padding``).
    """

    dataset: Any
    batch_size: int
    every_n_steps: Optional[int]
    pad_id: int
    ctx: DistributedContext
    padding: dict[str, Any] = field(default_factory=dict)

    def batches(self) -> Iterator[dict[str, torch.Tensor]]:
        """This rank's batches of one pass (every sample once over all ranks; see ``evaluation_batches``)."""
        return evaluation_batches(self.dataset, batch_size=self.batch_size, pad_id=self.pad_id,
                                  rank=self.ctx.rank, world_size=self.ctx.world_size, **self.padding)

    def due(self, step: int, *, epoch_done: bool) -> bool:
        """Whether the step just finished is one to validate after."""
        return step % self.every_n_steps == 0 if self.every_n_steps else epoch_done


def build_validation(cfg: FullFinetuneConfig, tokenizer: Any, ctx: DistributedContext) -> Optional[ValidationData]:
    """The validation data, or None without ``dataset_val``."""
    if cfg.dataset_val is None:
        return None
    dataset = cfg.dataset_val.instantiate(tokenizer, max_seq_len=cfg.max_seq_len)
    if len(dataset) == 0:
        raise UserError("dataset_val: holds no sample")
    log.info("validation: %s, every %s", describe_samples(dataset),
             count_of(cfg.run_val_every_n_steps, "step") if cfg.run_val_every_n_steps else "epoch")
    return ValidationData(dataset, cfg.batch_size_val or cfg.batch_size, cfg.run_val_every_n_steps,
                          tokenizer.pad_id, ctx, batch_padding(cfg))


def build_scheduler(cfg: FullFinetuneConfig, stepper: Stepper, total_steps: int) -> Optional[Any]:
    """The config's LR scheduler over the stepper's optimizer, for a run of ``total_steps``; None without one."""
    if cfg.lr_scheduler is None:
        return None
    return cfg.lr_scheduler.instantiate(stepper.optimizer, num_training_steps=total_steps)


def restore(cfg: FullFinetuneConfig, run: RunContext, checkpoint: Path, training: TrainingModel,
            scheduler: Optional[Any], data: RunData) -> Progress:
    """Load a resume's state (model, optimizer state, the schedule's position) after checking it belongs to this
    run; say which optimizer or schedule settings differ from the checkpoint's (this config's are used).

    Returns:
        The progress saved with ``checkpoint``.

    Raises:
        UserError: the checkpoint's run differs in what a resume must keep (its data included), or its finished
            epochs would be made longer by this config.
    """
    saved = read_trainer_state(checkpoint)
    progress = saved.progress
    check_resume_shape(checkpoint, saved.shape, run_shape(cfg, run.ctx.world_size, training.model, run.plan))
    if saved.data is None:
        log.warning("%s records no identity of its data (an earlier version wrote it): the data cannot be checked "
                    "against the checkpoint's", checkpoint.name)
    else:
        data_changes = describe_data_change(saved.data, data.identity, checkpoint.name)
        if data_changes:
            raise data_changed(checkpoint, data_changes)
    if progress.epoch >= cfg.epochs and progress.step < data.total_steps:
        raise finished_epochs_not_extended(checkpoint, progress, data.steps_per_epoch, data.total_steps)
    # The optimizer state comes from the checkpoint; its hyper-parameters and the schedule are this config's.
    load_checkpoint(checkpoint, model=training.model, optimizers=training.stepper.optimizers_to_checkpoint())
    if scheduler is not None:
        resume_schedule(scheduler, progress.step)
    log.info("resumed from %s at step %d", checkpoint, progress.step)
    changes = ([] if saved.hyperparameters is None
               else hyperparameter_changes(saved.hyperparameters, run_hyperparameters(cfg), checkpoint.name))
    if changes:
        log.info(hyperparameters_changed(changes))
    if saved.shape.world_size != run.ctx.world_size:
        log.info(resharded(saved.shape.world_size, run.ctx.world_size))
    return progress


def resume_schedule(scheduler: Any, step: int) -> None:
    """Set every learning rate to what this run's schedule gives at ``step`` (the steps already taken).

    A checkpoint holds no schedule: the scheduler was built from this run's config (its keys, the optimizer's
    ``lr`` as base rate, and the run's length, which may have changed since: ``epochs`` raised to train more,
    ``max_steps_per_epoch`` changed), so stepping it to ``step`` gives this config's rates before the first
    resumed step uses them. An unchanged config gives the saved run's rates exactly.
    """
    scheduler.last_epoch = step - 1
    scheduler.step()


@dataclass(frozen=True)
class SavePolicy:
    """When a step ends with a checkpoint: at the end of every epoch, every ``every_n_steps`` steps (None:
    never in between), and on a stop signal."""

    every_n_steps: Optional[int]

    def should_save(self, step: int, *, epoch_done: bool, stopping: bool) -> bool:
        return epoch_done or stopping or bool(self.every_n_steps and step % self.every_n_steps == 0)

    def saves(self, after_step: int, data: RunData) -> int:
        """The checkpoints a run writes from ``after_step`` to its end (no stop signal)."""
        return sum(self.should_save(step, epoch_done=step % data.steps_per_epoch == 0, stopping=False)
                   for step in range(after_step + 1, data.total_steps + 1))


@dataclass(frozen=True)
class CheckpointSize:
    """What one checkpoint of the run takes on disk, estimated from the model and the optimizer's state layout.

    Attributes:
        hf_bytes: the model in Hugging Face format (its parameters in their dtype) and the tokenizer files.
        recipe_bytes: the recipe state: the model again, and the optimizer state (``memory.optimizer_state``'s
            layout; none counted for an optimizer whose layout is not known here).
    """

    hf_bytes: int
    recipe_bytes: int

    @property
    def total(self) -> int:
        return self.hf_bytes + self.recipe_bytes


def estimate_checkpoint_size(cfg: FullFinetuneConfig, model: nn.Module, tokenizer_dir: Path) -> CheckpointSize:
    """One checkpoint's size on disk (see ``CheckpointSize``); the parameters' global shapes, sharded or not."""
    params = list({id(p): p for p in model.parameters()}.values())
    model_bytes = sum(p.numel() * p.dtype.itemsize for p in params)
    layout = layout_of(cfg.optimizer.path, cfg.optimizer.kwargs)
    optimizer_bytes = 0 if layout is None else state_bytes(layout, [tuple(p.shape) for p in params], params[0].dtype)
    tokenizer_bytes = sum((tokenizer_dir / name).stat().st_size for name in TOKENIZER_FILES
                          if (tokenizer_dir / name).is_file())
    return CheckpointSize(model_bytes + tokenizer_bytes, model_bytes + optimizer_bytes)


def check_disk_space(cfg: FullFinetuneConfig, ctx: DistributedContext, size: CheckpointSize, saves: int) -> None:
    """Before the first step: refuse a run whose ``output_dir`` cannot hold one checkpoint, and warn when it cannot
    hold what ``keep_last_n_checkpoints`` keeps of the ``saves`` the run will write (every rank calls this; rank 0
    reads the free space and warns).

    What is kept at most: with ``keep_last_n_checkpoints: N``, N checkpoints and the next one being written
    (older ones are pruned once it is complete); with null, every checkpoint's Hugging Face files, and the recipe
    state of the newest ``RESUMABLE_KEPT`` and of the one being written.

    Raises:
        UserError: the free space is less than one checkpoint (on every rank).
    """
    if saves == 0:
        return
    free = agreed_free_bytes(cfg.output_dir)
    if free < size.total:
        raise disk_too_small(cfg.output_dir, free, size.total)
    keep = cfg.keep_last_n_checkpoints
    if keep is None:
        needed = saves * size.hf_bytes + min(saves, RESUMABLE_KEPT + 1) * size.recipe_bytes
    else:
        needed = min(saves, keep + 1) * size.total
    if free < needed and ctx.is_rank_zero:
        log.warning(disk_may_fill(cfg.output_dir, free, needed, saves, size, keep))
