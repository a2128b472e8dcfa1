"""The set-up phases of a training run besides the plan and the model, each a function that returns a typed value.
A recipe calls them in order (``recipes/full_finetune.py``); another recipe composes the same ones, or its own.

    choose_resume     the checkpoint to continue from (resume_from_checkpoint)           -> ResumeChoice
    build_data        the instruction/chat/text data loader of this rank                 -> RunData
    build_validation  the held-out data of the validation loss, and when to compute it   -> ValidationData
    restore           a resume's progress, model, optimizer and scheduler state          -> Progress
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator, Optional

import torch

from torchtune_ac.checkpoint import (
    Progress,
    ResumeChoice,
    check_resume_shape,
    choose_resume_checkpoint,
    load_checkpoint,
    read_trainer_state,
)
from torchtune_ac.data import build_dataloader
from torchtune_ac.data.collate import COMPILED_LENGTH_MULTIPLE
from torchtune_ac.data.sampler import evaluation_batches
from torchtune_ac.errors import UserError
from torchtune_ac.run.assemble import Training
from torchtune_ac.run.messages import finished_epochs_not_extended, resharded
from torchtune_ac.run.plan import RunPlan, TrainingConfig
from torchtune_ac.runtime.distributed import DistributedContext

log = logging.getLogger("torchtune_ac.run")


def choose_resume(cfg: TrainingConfig, ctx: DistributedContext) -> ResumeChoice:
    """The checkpoint a resume continues from (every file's hash checked, the ranks sharing the hashing and agreeing
    on the answer); no checkpoint when ``resume_from_checkpoint`` is false. Newer checkpoints that were skipped are
    logged."""
    if not cfg.resume_from_checkpoint:
        return ResumeChoice(None)
    choice = choose_resume_checkpoint(cfg.output_dir, hashes=True, processes=ctx)
    for skipped in choice.skipped:
        log.warning("resume: %s", skipped)
    return choice


@dataclass
class RunData:
    """The data of a run.

    Attributes:
        loader: this rank's batches (``set_epoch``, ``skip_steps``; its length: batches per epoch).
        samples: samples in the dataset.
    """

    loader: Any
    samples: int


def batch_padding(cfg: TrainingConfig) -> dict[str, Any]:
    """How batches are padded: compiled blocks get lengths that repeat (multiples of ``COMPILED_LENGTH_MULTIPLE``,
    at most ``max_seq_len``), so that they are not recompiled for each new length; eager ones, the longest
    sample's."""
    if not cfg.compile:
        return {"pad_to_multiple_of": 1}
    return {"pad_to_multiple_of": COMPILED_LENGTH_MULTIPLE, "max_length": cfg.max_seq_len}


def build_data(cfg: TrainingConfig, tokenizer: Any, ctx: DistributedContext) -> RunData:
    """The dataset and this rank's loader (batches in pinned memory for a CUDA run, so that their copy to the GPU is
    asynchronous; padded as ``batch_padding`` says). How many steps it makes is the plan's (``resolve_length``)."""
    dataset = cfg.dataset.instantiate(tokenizer, max_seq_len=cfg.max_seq_len)
    loader = build_dataloader(dataset, batch_size=cfg.batch_size, rank=ctx.rank, world_size=ctx.world_size,
                              shuffle=cfg.shuffle, seed=cfg.seed, pad_id=tokenizer.pad_id,
                              **batch_padding(cfg), pin_memory=ctx.device.type == "cuda")
    return RunData(loader, len(dataset))


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


def build_validation(cfg: TrainingConfig, tokenizer: Any, ctx: DistributedContext) -> Optional[ValidationData]:
    """The validation data, or None without ``dataset_val``."""
    if cfg.dataset_val is None:
        return None
    dataset = cfg.dataset_val.instantiate(tokenizer, max_seq_len=cfg.max_seq_len)
    if len(dataset) == 0:
        raise UserError("dataset_val: holds no sample")
    log.info("validation: %d samples, every %s", len(dataset),
             f"{cfg.run_val_every_n_steps} steps" if cfg.run_val_every_n_steps else "epoch")
    return ValidationData(dataset, cfg.batch_size_val or cfg.batch_size, cfg.run_val_every_n_steps,
                          tokenizer.pad_id, ctx, batch_padding(cfg))


def restore(plan: RunPlan, ctx: DistributedContext, checkpoint: Path, training: Training) -> Progress:
    """Load a resume's state (model, optimizers, scheduler) after checking it belongs to this run.

    Returns:
        The progress saved with ``checkpoint``.

    Raises:
        UserError: the checkpoint's run differs in what a resume must keep, or its finished epochs would be
            made longer by this config.
    """
    saved_progress, saved_shape = read_trainer_state(checkpoint)
    check_resume_shape(checkpoint, saved_shape, plan.resume_shape())
    length = plan.length
    if saved_progress.epoch >= length.epochs and saved_progress.step < length.total_steps:
        raise finished_epochs_not_extended(checkpoint, saved_progress, length.steps_per_epoch, length.total_steps)
    load_checkpoint(checkpoint, model=training.model, optimizers=training.stepper.optimizers_to_checkpoint(),
                    scheduler=training.scheduler, processes=ctx)
    if training.scheduler is not None:
        resume_schedule(training.scheduler, saved_progress.step)
    log.info("resumed from %s at step %d", checkpoint, saved_progress.step)
    if saved_shape.world_size != ctx.world_size:
        log.info(resharded(saved_shape.world_size, ctx.world_size))
    return saved_progress


def resume_schedule(scheduler: Any, step: int) -> None:
    """Set every learning rate to what this run's schedule gives at ``step`` (the steps already taken).

    A checkpoint holds the learning rates the saved run's schedule reached. When the run's length changed since
    (``epochs`` raised to train more, ``max_steps_per_epoch`` changed), those belong to the old schedule: the
    last step of a finished run has decayed to 0. The scheduler was built for the new length, so stepping it to
    ``step`` again gives the new schedule's rates, before the first resumed step uses them.
    """
    scheduler.last_epoch = step - 1
    scheduler.step()
