"""Checkpoints written by a run, and exact resume from them.

Layout of ``output_dir``::

    step_0000040/                  one directory per save (end of each epoch, every save_every_n_steps)
        config.json, model*.safetensors[, model.safetensors.index.json], tokenizer files
                                   the model in Hugging Face format: AutoModelForCausalLM.from_pretrained(here)
        recipe_state/              only in the newest checkpoint (older ones are pruned when a new one lands)
            .metadata, *.distcp    model + optimizer, torch.distributed.checkpoint (sharded when FSDP)
            trainer_state.json     step, epoch, position in the epoch, run shape (world size, batch sizes, model)
            scheduler.pt           learning-rate scheduler state
            rng_rank{r}.pt         each rank's RNG state (dropout masks continue exactly)
    metrics.jsonl

Every checkpoint is written by ``files.write_directory`` (a temporary name, renamed into place when
complete), so a killed run never leaves a checkpoint that looks complete but is not; the base checkpoint
directory is only ever read. Every function here is a collective call when a process group is initialised: all
ranks call it.
"""

from __future__ import annotations

import json
import re
import shutil
import warnings
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Iterator, Optional, Sequence

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from torchtune_ac.checkpoint.files import is_writer_rank, process_group_active, remove_debris, write_directory
from torchtune_ac.checkpoint.hf import write_hf_files
from torchtune_ac.errors import UserError

RECIPE_STATE_DIR = "recipe_state"
TRAINER_STATE_FILE = "trainer_state.json"
_CHECKPOINT_RE = re.compile(r"^step_(\d+)$")


@dataclass(frozen=True)
class Progress:
    """Where training stands: optimizer steps done in total, the current epoch, and steps done in it."""

    step: int = 0
    epoch: int = 0
    step_in_epoch: int = 0


@dataclass(frozen=True)
class RunShape:
    """What must not change between a run and its resume for the resume to be exact.

    ``data`` holds what decides the batches (seed, shuffle, max_seq_len, the dataset and tokenizer settings),
    as plain JSON values.
    """

    world_size: int
    batch_size: int
    gradient_accumulation_steps: int
    model_args: dict[str, Any]
    data: dict[str, Any]


@contextmanager
def _single_process_dcp_quiet() -> Iterator[None]:
    # A world of one saves and loads without a process group on purpose; DCP warns about exactly that.
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


def checkpoint_name(step: int) -> str:
    return f"step_{step:07d}"


def create_output_dir(output_dir: str | Path) -> Path:
    """Create ``output_dir`` and its parents if missing.

    Raises:
        UserError: it cannot be created (a read-only or virtual file system, a parent that is a file, ...).
    """
    path = Path(output_dir)
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise UserError(f"output_dir {path}: cannot create it ({err.strerror}: {err.filename})") from None
    return path


def list_checkpoints(output_dir: str | Path) -> list[Path]:
    """Complete checkpoint directories in ``output_dir``, oldest first."""
    root = Path(output_dir)
    if not root.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in root.iterdir() if p.is_dir() and (m := _CHECKPOINT_RE.match(p.name))]
    return [p for _, p in sorted(found)]


def find_resumable_checkpoint(output_dir: str | Path) -> Optional[Path]:
    """The newest checkpoint in ``output_dir`` that carries recipe state, or None."""
    for path in reversed(list_checkpoints(output_dir)):
        if (path / RECIPE_STATE_DIR / TRAINER_STATE_FILE).is_file():
            return path
    return None


def _barrier() -> None:
    if process_group_active():
        dist.barrier()


def save_checkpoint(
    output_dir: str | Path,
    *,
    model: nn.Module,
    optimizers: Sequence[torch.optim.Optimizer],
    scheduler: Optional[Any],
    progress: Progress,
    shape: RunShape,
    tokenizer_dir: Optional[str | Path] = None,
    hf_config_extra: Optional[dict[str, Any]] = None,
) -> Path:
    """Write a complete checkpoint for ``progress.step`` (all ranks must call this).

    The Hugging Face files are written by rank 0 (a sharded model gathered one output shard at a time, so no
    rank holds the whole model), the recipe state by every rank (DCP: each rank its own shard), all into one
    temporary directory that rank 0 renames into place once every rank is done. Older checkpoints then lose
    their recipe state (only the newest one resumes). ``optimizers`` is the optimizer, or the per-parameter
    optimizers of a step in backward: their state is saved by parameter name either way.

    Returns:
        The checkpoint directory.
    """
    root = Path(output_dir)
    final = root / checkpoint_name(progress.step)
    if is_writer_rank():
        remove_debris(root)  # what a run killed while saving left behind
    _barrier()

    def write(tmp: Path) -> None:
        write_hf_files(model, tmp, tokenizer_dir=tokenizer_dir, **(hf_config_extra or {}))
        _save_recipe_state(tmp / RECIPE_STATE_DIR, model=model, optimizers=optimizers, scheduler=scheduler,
                           progress=progress, shape=shape)

    # overwrite: an earlier save of this very step (epoch end == save_every_n_steps) is replaced.
    write_directory(final, write, overwrite=True, collective=True)
    if is_writer_rank():
        for older in list_checkpoints(root):
            if older != final and (older / RECIPE_STATE_DIR).exists():
                shutil.rmtree(older / RECIPE_STATE_DIR)
    _barrier()
    return final


def _save_recipe_state(
    state_dir: Path,
    *,
    model: nn.Module,
    optimizers: Sequence[torch.optim.Optimizer],
    scheduler: Optional[Any],
    progress: Progress,
    shape: RunShape,
) -> None:
    """Model + optimizer through DCP (every rank its shard), each rank's RNG state; rank 0 the small files."""
    state = {"model": get_model_state_dict(model), "optimizer": get_optimizer_state_dict(model, optimizers)}
    with _single_process_dcp_quiet():
        dcp.save(state, checkpoint_id=state_dir, no_dist=not process_group_active())
    rank = dist.get_rank() if process_group_active() else 0
    rng = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        rng["cuda"] = torch.cuda.get_rng_state()
    torch.save(rng, state_dir / f"rng_rank{rank}.pt")
    if is_writer_rank():
        if scheduler is not None:
            torch.save(scheduler.state_dict(), state_dir / "scheduler.pt")
        trainer_state = {"progress": asdict(progress), "shape": asdict(shape)}
        (state_dir / TRAINER_STATE_FILE).write_text(json.dumps(trainer_state, indent=2))


def read_trainer_state(checkpoint: Path) -> tuple[Progress, RunShape]:
    """Progress and run shape recorded in ``checkpoint``."""
    data = json.loads((checkpoint / RECIPE_STATE_DIR / TRAINER_STATE_FILE).read_text())
    return Progress(**data["progress"]), RunShape(**data["shape"])


def check_resume_shape(checkpoint: Path, saved: RunShape, current: RunShape) -> None:
    """Refuse a resume that could not continue exactly.

    Raises:
        UserError: naming each setting that differs between the checkpoint and this run.
    """
    problems = []
    for name in ("world_size", "batch_size", "gradient_accumulation_steps"):
        if getattr(saved, name) != getattr(current, name):
            problems.append(f"{name} was {getattr(saved, name)}, now {getattr(current, name)}")
    model_diff = [
        f"{key} {saved.model_args.get(key)} -> {current.model_args.get(key)}"
        for key in sorted(set(saved.model_args) | set(current.model_args))
        if saved.model_args.get(key) != current.model_args.get(key)
    ]
    if model_diff:
        problems.append("the model has a different shape (" + ", ".join(model_diff) + ")")
    for key in sorted(set(saved.data) | set(current.data)):
        if saved.data.get(key) != current.data.get(key):
            was, now = (json.dumps(shape.data.get(key), sort_keys=True) for shape in (saved, current))
            problems.append(f"{key} was {was}, now {now}")
    if problems:
        raise UserError(f"resume from {checkpoint}: cannot continue exactly: " + "; ".join(problems))


def load_checkpoint(
    checkpoint: Path,
    *,
    model: nn.Module,
    optimizers: Sequence[torch.optim.Optimizer],
    scheduler: Optional[Any],
) -> None:
    """Restore model, optimizer(s), scheduler and this rank's RNG state from ``checkpoint`` (all ranks call this)."""
    state_dir = checkpoint / RECIPE_STATE_DIR
    state = {"model": get_model_state_dict(model), "optimizer": get_optimizer_state_dict(model, optimizers)}
    with _single_process_dcp_quiet():
        dcp.load(state, checkpoint_id=state_dir, no_dist=not process_group_active())
    set_model_state_dict(model, state["model"])
    set_optimizer_state_dict(model, optimizers, state["optimizer"])
    if scheduler is not None:
        scheduler.load_state_dict(torch.load(state_dir / "scheduler.pt", weights_only=True))
    rank = dist.get_rank() if process_group_active() else 0
    rng = torch.load(state_dir / f"rng_rank{rank}.pt", weights_only=True)
    torch.set_rng_state(rng["cpu"])
    if "cuda" in rng:
        torch.cuda.set_rng_state(rng["cuda"])
    _barrier()
