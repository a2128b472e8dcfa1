"""The set-up phases of a training run besides the plan and the model, each a function that returns a typed value.
A recipe calls them in order (``recipes/full_finetune.py``); another recipe composes the same ones, or its own.

    choose_resume     the checkpoint to continue from (resume_from_checkpoint)                  -> ResumeChoice
    build_data        the instruction/chat/text data loader of this rank, and its identity      -> RunData
    build_validation  the held-out data of the validation loss, and when to compute it          -> ValidationData
    restore           a resume's progress, model and optimizer state; this config's hyper-parameters -> Progress
    check_disk_space  before the first step: room for one checkpoint (refused), for those kept (warned)
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator, Optional

import torch

from torch import nn

from torchtune_ac.checkpoint import (
    RESUMABLE_KEPT,
    TOKENIZER_FILES,
    Progress,
    ResumeChoice,
    agreed_free_bytes,
    check_resume_shape,
    choose_resume_checkpoint,
    describe_data_change,
    identify_data,
    load_checkpoint,
    read_trainer_state,
)
from torchtune_ac.data import build_dataloader
from torchtune_ac.data.batching import SAMPLES, Batching
from torchtune_ac.data.collate import COMPILED_LENGTH_MULTIPLE
from torchtune_ac.data.sampler import evaluation_batches
from torchtune_ac.data.samples import count_of, describe_samples
from torchtune_ac.errors import UserError
from torchtune_ac.memory.optimizer_state import layout_of, state_bytes
from torchtune_ac.run.assemble import AssembledModel
from torchtune_ac.run.messages import (
    data_changed,
    disk_may_fill,
    disk_too_small,
    finished_epochs_not_extended,
    hyperparameter_changes,
    hyperparameters_changed,
    naming_dataset_val,
    resharded,
)
from torchtune_ac.run.plan import RunConfig, RunPlan
from torchtune_ac.runtime.distributed import DistributedContext
from torchtune_ac.runtime.parallelism import Parallelism

log = logging.getLogger("torchtune_ac.run")


def choose_resume(cfg: RunConfig, ctx: DistributedContext) -> ResumeChoice:
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
        samples: samples in the dataset (rows, when packed).
        identity: what identifies the data (each file's size and SHA-256, the sample count), which a checkpoint
            records and a resume checks (``checkpoint.identify_data``).
        described: what the dataset holds, for the start-up log: ``3,000 samples``, or for a packed one
            ``packed: 3,000 samples -> 412 rows of 256 tokens, 93.1 % filled``.
        unit: what one of ``samples`` is: ``sample``, or ``row`` when packed.
    """

    loader: Any
    samples: int
    identity: dict[str, Any]
    described: str = ""
    unit: str = "sample"


def batch_padding(cfg: RunConfig, parallelism: Parallelism) -> dict[str, Any]:
    """How batches are padded: compiled blocks get lengths that repeat (multiples of ``COMPILED_LENGTH_MULTIPLE``,
    at most ``max_seq_len``), so that they are not recompiled for each new length; eager ones, the longest
    sample's. Under tensor parallelism every length is also a multiple of its degree (the sequence is split evenly
    over a group; the plan checked that it divides ``max_seq_len``)."""
    if not cfg.compile:
        return {"pad_to_multiple_of": parallelism.tensor}
    return {"pad_to_multiple_of": math.lcm(COMPILED_LENGTH_MULTIPLE, parallelism.tensor),
            "max_length": cfg.max_seq_len}


def build_data(cfg: RunConfig, tokenizer: Any, ctx: DistributedContext, *,
               batching: Batching = SAMPLES) -> RunData:
    """The dataset, this rank's loader (batches in pinned memory for a CUDA run, so that their copy to the GPU is
    asynchronous; padded as ``batch_padding`` says; made as ``batching`` says: samples, or a recipe's own, such as
    preference pairs), and what identifies the data (its files hashed once, the ranks sharing the reading). How many
    steps it makes is the plan's (``RunPlan.with_data``)."""
    dataset = cfg.dataset.instantiate(tokenizer, max_seq_len=cfg.data_max_seq_len)
    batching.check_kind(dataset, "dataset", cfg.dataset.path)
    # Each tensor-parallel group reads one share of the global batch, the same on each of its ranks.
    loader = build_dataloader(dataset, batch_size=cfg.data_batch_size, rank=ctx.data_parallel_rank,
                              world_size=ctx.data_parallel_size,
                              shuffle=cfg.shuffle, seed=cfg.seed, pad_id=tokenizer.pad_id,
                              collate=batching.collate_of(dataset),
                              **batch_padding(cfg, ctx.parallelism), pin_memory=ctx.device.type == "cuda",
                              announce=ctx.is_rank_zero)
    files = dataset.source_files
    identity = identify_data(dataset.source, files and files.root, files and files.names, len(dataset),
                             processes=ctx, hub=files.hub if files else ())
    unit = "row" if getattr(dataset, "packing", None) is not None else "sample"
    return RunData(loader, len(dataset), identity, describe_samples(dataset), unit)


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
        batching: how samples become batches.
    """

    dataset: Any
    batch_size: int
    every_n_steps: Optional[int]
    pad_id: int
    ctx: DistributedContext
    padding: dict[str, Any] = field(default_factory=dict)
    batching: Batching = SAMPLES

    def batches(self) -> Iterator[dict[str, torch.Tensor]]:
        """This rank's batches of one pass (every sample once over all ranks; see ``evaluation_batches``)."""
        return evaluation_batches(self.dataset, batch_size=self.batch_size, pad_id=self.pad_id,
                                  rank=self.ctx.data_parallel_rank, world_size=self.ctx.data_parallel_size,
                                  collate=self.batching.collate_of(self.dataset),
                                  blank=self.batching.blank, **self.padding)

    def due(self, step: int, *, epoch_done: bool) -> bool:
        """Whether the step just finished is one to validate after."""
        return step % self.every_n_steps == 0 if self.every_n_steps else epoch_done


def build_validation(cfg: RunConfig, tokenizer: Any, ctx: DistributedContext, *,
                     batching: Batching = SAMPLES) -> Optional[ValidationData]:
    """The validation data, batched as ``batching`` says, or None without ``dataset_val``."""
    if cfg.dataset_val is None:
        return None
    try:
        dataset = cfg.dataset_val.instantiate(tokenizer, max_seq_len=cfg.max_seq_len)
    except UserError as err:
        raise naming_dataset_val(err) from None
    if len(dataset) == 0:
        raise UserError("dataset_val: holds no sample")
    batching.check_kind(dataset, "dataset_val", cfg.dataset_val.path)
    log.info("validation: %s, every %s", describe_samples(dataset),
             count_of(cfg.run_val_every_n_steps, "step") if cfg.run_val_every_n_steps else "epoch")
    return ValidationData(dataset, cfg.batch_size_val or cfg.batch_size, cfg.run_val_every_n_steps,
                          tokenizer.pad_id, ctx, batch_padding(cfg, ctx.parallelism), batching)


def restore(plan: RunPlan, ctx: DistributedContext, checkpoint: Path, training: AssembledModel, data: RunData) -> Progress:
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
    check_resume_shape(checkpoint, saved.shape, plan.resume_shape())
    if saved.data is None:
        log.warning("%s records no identity of its data (an earlier version wrote it): the data cannot be checked "
                    "against the checkpoint's", checkpoint.name)
    else:
        data_changes = describe_data_change(saved.data, data.identity, checkpoint.name)
        if data_changes:
            raise data_changed(checkpoint, data_changes)
    length = plan.length
    if progress.epoch >= length.epochs and progress.step < length.total_steps:
        raise finished_epochs_not_extended(checkpoint, progress, length.steps_per_epoch, length.total_steps)
    # The optimizer state comes from the checkpoint; its hyper-parameters and the schedule are this config's.
    load_checkpoint(checkpoint, model=training.model, optimizers=training.stepper.optimizers_to_checkpoint(),
                    processes=ctx)
    if training.scheduler is not None:  # the schedule counts optimizer steps (GRPO takes several a step)
        resume_schedule(training.scheduler, progress.step * length.optimizer_steps_per_step)
    log.info("resumed from %s at step %d", checkpoint, progress.step)
    changes = ([] if saved.hyperparameters is None
               else hyperparameter_changes(saved.hyperparameters, dict(plan.hyperparameters), checkpoint.name))
    if changes:
        log.info(hyperparameters_changed(changes))
    if saved.shape.world_size != ctx.world_size:
        log.info(resharded(saved.shape.world_size, ctx.world_size, dropout=uses_dropout(training.model)))
    return progress


def uses_dropout(model: nn.Module) -> bool:
    """Whether training ``model`` draws random dropout masks: a torch dropout module with ``p > 0``, or an
    attention whose ``dropout`` probability (passed to SDPA, as ours is) is above 0."""
    for module in model.modules():
        if isinstance(module, nn.modules.dropout._DropoutNd) and module.p > 0:
            return True
        probability = getattr(module, "dropout", None)
        if isinstance(probability, float) and probability > 0:
            return True
    return False


def resume_schedule(scheduler: Any, step: int) -> None:
    """Set every learning rate to what this run's schedule gives at ``step`` (the optimizer steps already taken).

    A checkpoint holds no schedule: the scheduler was built from this run's config (its keys, the optimizer's
    ``lr`` as base rate, and the run's length, which may have changed since: ``epochs`` raised to train more,
    ``max_steps_per_epoch`` changed), so stepping it to ``step`` gives this config's rates before the first
    resumed step uses them. An unchanged config gives the saved run's rates exactly.
    """
    scheduler.last_epoch = step - 1
    scheduler.step()


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


def estimate_checkpoint_size(cfg: RunConfig, model: nn.Module, tokenizer_dir: Path) -> CheckpointSize:
    """One checkpoint's size on disk (see ``CheckpointSize``); the parameters' global shapes, sharded or not."""
    params = list({id(p): p for p in model.parameters()}.values())
    model_bytes = sum(p.numel() * p.dtype.itemsize for p in params)
    layout = layout_of(cfg.optimizer.path, cfg.optimizer.kwargs)
    optimizer_bytes = 0 if layout is None else state_bytes(layout, [tuple(p.shape) for p in params], params[0].dtype)
    tokenizer_bytes = sum((tokenizer_dir / name).stat().st_size for name in TOKENIZER_FILES
                          if (tokenizer_dir / name).is_file())
    return CheckpointSize(model_bytes + tokenizer_bytes, model_bytes + optimizer_bytes)


def check_disk_space(plan: RunPlan, ctx: DistributedContext, size: CheckpointSize, saves: int) -> None:
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
    free = agreed_free_bytes(plan.output_dir, ctx)
    if free < size.total:
        raise disk_too_small(plan.output_dir, free, size.total)
    keep = plan.save.keep_last_n
    if keep is None:
        needed = saves * size.hf_bytes + min(saves, RESUMABLE_KEPT + 1) * size.recipe_bytes
    else:
        needed = min(saves, keep + 1) * size.total
    if free < needed and ctx.is_rank_zero:
        log.warning(disk_may_fill(plan.output_dir, free, needed, saves, size, keep))
