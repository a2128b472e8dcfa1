"""Checkpoints written by a run, and exact resume from them.

Layout of ``output_dir``::

    step_0000040/                  one directory per save (end of each epoch, every save_every_n_steps, a stop)
        config.json, model*.safetensors[, model.safetensors.index.json], tokenizer files
                                   the model in Hugging Face format: AutoModelForCausalLM.from_pretrained(here)
                                   (a run with adapters: adapter_config.json, adapter_model.safetensors, its PEFT
                                   folder, and the tokenizer files instead)
        merged/                    a run with adapters and adapter.save_merged: the merged model (base + adapters)
                                   in Hugging Face format, with the tokenizer files, loaded alone from here
        recipe_state/              in the checkpoints a resume may use (see "Keeping checkpoints" below)
            .metadata, *.distcp    model + optimizer, torch.distributed.checkpoint (sharded when FSDP; loads into
                                   another number of processes)
            trainer_state.json     step, epoch, position in the epoch, run shape (world size, batch sizes, model),
                                   the optimizer and schedule settings it ran with, what identifies its data
                                   (each file's size and SHA-256, the sample count: ``data_identity.py``)
            rng_rank{r}.pt         each rank's RNG state (dropout masks continue exactly on the same world size)
        manifest.json              written last: every other file's size and SHA-256 (``manifest.py``)
    latest                         the newest checkpoint that matched its manifest (a link, or a file naming it)
    metrics.jsonl

Every checkpoint is written by ``files.write_directory`` (a temporary name, renamed into place when complete),
so a killed run never leaves a checkpoint that looks complete but is not; the base checkpoint directory is only
ever read. No schedule state is saved: a resume's learning rate is its own config's schedule at the saved step.
Each step of a save is agreed on by every rank (``files.run_on_every_rank``): a rank whose write fails
(a full disk) makes every rank stop with the same one-line error, and the temporary directory is removed.

Resume takes the newest checkpoint whose recipe state matches its manifest (sizes, then every file's SHA-256,
the ranks sharing the reading); one that does not is skipped, with a warning naming the bad file, for the
previous one. A newest checkpoint without its ``recipe_state/`` folder (not written by a run, or the folder
deleted) is refused rather than superseded, and left as it is.

Keeping checkpoints: once a new checkpoint is renamed into place and matches its manifest, older ones are pruned.
With ``keep_last_n_checkpoints: N`` the newest N checkpoints are kept whole and older ones deleted; with null
(the default) every checkpoint keeps its Hugging Face files, and the recipe state is kept in the newest
``RESUMABLE_KEPT`` (2) only, so a damaged newest checkpoint has one to fall back on. (Before manifests, only the
newest kept its recipe state; the second costs one more copy of the model and optimizer state, about 3x the
model's bytes with AdamW.) Checkpoints newer than the one just written (left by a run that resumed from an
earlier one, because they failed their manifest) are deleted too. Pruning renames a directory away before
deleting it and rewrites a manifest before its recipe state goes, so a kill during pruning leaves nothing that
looks complete but is not.

``save_checkpoint``, ``load_checkpoint`` and ``choose_resume_checkpoint`` take the run's process context
(``processes``): with several processes every rank calls them; without (None) they act for this process alone. The
other functions are local.
"""

from __future__ import annotations

import copy
import json
import logging
import re
import warnings
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Iterator, Optional, Sequence

import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from torchtune_ac.checkpoint.files import (
    CollectiveStepFailed,
    discard_directory,
    leads,
    read_json,
    read_pointer,
    remove_debris,
    run_on_every_rank,
    together,
    write_directory,
    write_pointer,
)
from torchtune_ac.checkpoint.hf import CONFIG_FILE, HFModelFiles, copy_tokenizer_files, write_hf_files
from torchtune_ac.checkpoint.peft import ADAPTER_CONFIG_FILE, AdapterFiles, write_adapter_files
from torchtune_ac.checkpoint.manifest import (
    MANIFEST_FILE,
    check_against_manifest,
    read_manifest,
    write_manifest,
    write_manifest_without,
)
from torchtune_ac.errors import UserError
from torchtune_ac.runtime.distributed import DistributedContext

RECIPE_STATE_DIR = "recipe_state"
TRAINER_STATE_FILE = "trainer_state.json"
# output_dir/latest: the newest checkpoint that matched its manifest once written (a link, or a file naming it).
LATEST_POINTER = "latest"
# A run with adapters saves its merged model here, apart from its PEFT folder: transformers, with peft installed,
# would apply adapters it finds beside a model's config.json to that model (here, a second time).
MERGED_DIR = "merged"
# Newest checkpoints that keep their recipe state when keep_last_n_checkpoints is null: one to resume from, and
# one to fall back on if it is damaged.
RESUMABLE_KEPT = 2
_CHECKPOINT_RE = re.compile(r"^step_(\d+)$")
_TRAINER_STATE = f"{RECIPE_STATE_DIR}/{TRAINER_STATE_FILE}"
# What a param group holds besides its hyper-parameters.
_GROUP_MEMBERS = ("params", "param_names")
log = logging.getLogger(__name__)
# The recipe state holds what trains: a frozen base (adapters, torchtune_ac/lora/) is read again from checkpoint_dir
# on resume, not saved a second time; for full training this is every parameter.
TRAINED_ONLY = StateDictOptions(ignore_frozen_params=True, strict=False)


@dataclass(frozen=True)
class Progress:
    """Where training stands: optimizer steps done in total, the current epoch, and steps done in it."""

    step: int = 0
    epoch: int = 0
    step_in_epoch: int = 0


@dataclass(frozen=True)
class RunShape:
    """What must carry over from a run to its resume for the resume to continue the same run.

    ``data`` holds what decides the batches (seed, shuffle, max_seq_len, the dataset and tokenizer settings) and
    the optimizer's class (whose state the checkpoint holds), as plain JSON values. The world size, batch size and accumulation may each change, as long as the global
    batch (their product) stays the same: the sampler makes each step out of the same samples then. So may
    ``tensor_parallel_dim``: the processes of one tensor-parallel group read one batch together, so the global batch
    counts the groups (a checkpoint of an earlier version records none: 1).
    """

    world_size: int
    batch_size: int
    gradient_accumulation_steps: int
    model_args: dict[str, Any]
    data: dict[str, Any]
    tensor_parallel_dim: int = 1

    @property
    def global_batch(self) -> int:
        """Samples per optimizer step, over all ranks (a tensor-parallel group's once)."""
        return self.batch_size * self.gradient_accumulation_steps * (self.world_size // self.tensor_parallel_dim)

    def describe_batch(self) -> str:
        readers = (f"{self.world_size} process(es)" if self.tensor_parallel_dim == 1 else
                   f"{self.world_size} process(es) / tensor_parallel_dim {self.tensor_parallel_dim}")
        return (f"{self.global_batch} (batch_size {self.batch_size} x gradient_accumulation_steps "
                f"{self.gradient_accumulation_steps} x {readers})")


@dataclass(frozen=True)
class RecipeState:
    """What ``trainer_state.json`` records of a checkpoint's run.

    Attributes:
        progress: where training stood.
        shape: what a resume must keep (``RunShape``).
        hyperparameters: the ``optimizer`` and ``lr_scheduler`` config sections the run trained with (plain JSON
            values, the scheduler None without one); a resume takes its own config's, and says what changed. None
            in a checkpoint of an earlier version, which recorded none.
        data: what identifies the training data (``data_identity.identify_data``); a resume refuses other data.
            None in a checkpoint of an earlier version: the resume says the data cannot be checked.
    """

    progress: Progress
    shape: RunShape
    hyperparameters: Optional[dict[str, Any]]
    data: Optional[dict[str, Any]]


@dataclass(frozen=True)
class ResumeChoice:
    """The checkpoint a resume continues from (None: there is none, the run starts at step 0), and why each newer
    one was skipped (one line each, naming the bad file)."""

    checkpoint: Optional[Path]
    skipped: tuple[str, ...] = ()


@contextmanager
def _single_process_dcp_quiet() -> Iterator[None]:
    # A world of one saves and loads without a process group on purpose; DCP warns about exactly that.
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


def checkpoint_name(step: int) -> str:
    return f"step_{step:07d}"


def _checkpoint_step(path: Path) -> int:
    match = _CHECKPOINT_RE.match(path.name)
    return int(match.group(1)) if match else -1


def list_checkpoints(output_dir: str | Path) -> list[Path]:
    """Checkpoint directories in ``output_dir``, oldest first."""
    root = Path(output_dir)
    if not root.is_dir():
        return []
    return sorted((p for p in root.iterdir() if p.is_dir() and _CHECKPOINT_RE.match(p.name)), key=_checkpoint_step)


def resolve_hf_checkpoint(path: str | Path) -> Path:
    """The Hugging Face checkpoint ``path`` names: ``path`` itself when it holds a config.json, else, for a run's
    ``output_dir``, the checkpoint its ``latest`` pointer names (for an ``output_dir`` written before pointers
    existed, its newest checkpoint that matches its manifest). A checkpoint of a run with adapters names its
    ``merged/`` model (``adapter.save_merged``).

    Raises:
        UserError: ``path`` does not exist, or is neither a checkpoint nor an ``output_dir`` holding one (naming
            what it lacks).
    """
    root = Path(path).expanduser()
    model = _hf_model_in(root)
    if model is not None:
        return model
    if not root.is_dir():
        raise UserError(f"checkpoint {root}: no such directory")
    if (root / ADAPTER_CONFIG_FILE).is_file():
        raise UserError(_adapters_only(root))
    name = read_pointer(root / LATEST_POINTER)
    if name is not None:
        target = root / name
        model = _hf_model_in(target) if _CHECKPOINT_RE.match(name) else None
        if model is None:
            if _CHECKPOINT_RE.match(name) and (target / ADAPTER_CONFIG_FILE).is_file():
                raise UserError(_adapters_only(target))
            raise UserError(f"checkpoint {root}: {root / LATEST_POINTER} names {name}, which is not a checkpoint "
                            "here; name a step_* folder instead")
        return model
    for checkpoint in reversed(list_checkpoints(root)):
        model = _hf_model_in(checkpoint)
        if model is not None and check_against_manifest(checkpoint, hashes=False) is None:
            return model
    raise UserError(f"checkpoint {root}: neither a Hugging Face checkpoint (no {CONFIG_FILE}, no "
                    f"{MERGED_DIR}/{CONFIG_FILE}) nor a run's output_dir with a checkpoint (no {LATEST_POINTER}, "
                    "no complete step_* folder)")


def _hf_model_in(checkpoint: Path) -> Optional[Path]:
    """The Hugging Face model folder of ``checkpoint``: itself, or its merged model's folder (None: neither)."""
    for folder in (checkpoint, checkpoint / MERGED_DIR):
        if (folder / CONFIG_FILE).is_file():
            return folder
    return None


def _adapters_only(checkpoint: Path) -> str:
    return (f"checkpoint {checkpoint}: the adapters of a LoRA run alone ({ADAPTER_CONFIG_FILE}, no "
            f"{MERGED_DIR}/{CONFIG_FILE}); load them onto their base with peft's PeftModel.from_pretrained, or train "
            f"with adapter.save_merged=true, whose checkpoints also hold the merged model in {MERGED_DIR}/")


def choose_resume_checkpoint(output_dir: str | Path, *, hashes: bool,
                             processes: Optional[DistributedContext] = None) -> ResumeChoice:
    """The newest checkpoint in ``output_dir`` whose recipe state matches its manifest.

    Args:
        output_dir: the run's directory.
        hashes: recompute each file's SHA-256 (the resume itself); False compares sizes only, reading no
            checkpoint file but the manifest and trainer_state.json (the start-up checks, ``tune validate``).
        processes: the run's processes: every rank calls this and the ranks share the hashing (None: this process
            alone).

    Returns:
        The checkpoint, and the newer ones skipped; no checkpoint when ``output_dir`` holds none with recipe state.

    Raises:
        UserError: there are checkpoints with recipe state, and none of them matches its manifest (naming each
            checkpoint's first bad file); or the newest checkpoint has no ``recipe_state/`` folder (never had one,
            or it was deleted): it is refused, not skipped, since a resume from an older one would replace it.
    """
    checkpoints = list_checkpoints(output_dir)
    candidates = [c for c in reversed(checkpoints) if _has_recipe_state(c)]
    if checkpoints and not (checkpoints[-1] / RECIPE_STATE_DIR).is_dir():
        raise _newest_without_recipe_state(Path(output_dir), checkpoints[-1], candidates)
    skipped = []
    for candidate in candidates:
        problem = check_against_manifest(candidate, hashes=hashes, processes=processes, require=_TRAINER_STATE)
        if problem is None:
            try:
                read_trainer_state(candidate)
            except UserError as err:
                problem = str(err)
        if problem is None:
            return ResumeChoice(candidate, tuple(skipped))
        skipped.append(f"{candidate.name} skipped: {problem}")
    if skipped:
        raise UserError(f"resume_from_checkpoint=true: no checkpoint in {output_dir} can be resumed: "
                        + "; ".join(skipped))
    return ResumeChoice(None)


def _newest_without_recipe_state(output_dir: Path, newest: Path, candidates: list[Path]) -> UserError:
    """The refusal of a newest checkpoint without its ``recipe_state/`` folder (see ``choose_resume_checkpoint``).

    A run keeps the recipe state of its newest checkpoint: this one came from elsewhere, or its recipe state was
    deleted. Resuming from an older one (or from step 0) would replace or delete it at the first save, as a
    superseded checkpoint; so nothing is touched, and the line says how to go on either way.
    """
    missing = "was deleted: its manifest lists it" if _has_recipe_state(newest) else "is missing"
    older = [c for c in candidates if c != newest]
    start = older[0].name if older else "step 0"
    ways = [f"to resume from {start}, move {newest.name} out of {output_dir}"]
    model = _hf_model_in(newest)
    if model is not None:
        ways.append(f"to train on from its weights, start a new run with checkpoint_dir={model} and another "
                    "output_dir")
    return UserError(
        f"resume_from_checkpoint=true: {newest} has no recipe state to continue from ({RECIPE_STATE_DIR}/ "
        f"{missing}), and a resume from {start} would replace or delete it when it saves; nothing was changed: "
        + "; ".join(ways)
    )


def _has_recipe_state(checkpoint: Path) -> bool:
    """Whether ``checkpoint`` was saved with recipe state: its folder is there, or its manifest lists it (then a
    missing folder is damage, which the manifest check names)."""
    if (checkpoint / RECIPE_STATE_DIR).is_dir():
        return True
    records, _ = read_manifest(checkpoint)
    return any(name.startswith(f"{RECIPE_STATE_DIR}/") for name in records or ())


def save_checkpoint(
    output_dir: str | Path,
    *,
    model: nn.Module,
    hf_files: Optional[HFModelFiles],
    optimizers: Sequence[torch.optim.Optimizer],
    state: RecipeState,
    adapter_files: Optional[AdapterFiles] = None,
    merged_files: Optional[HFModelFiles] = None,
    keep_last_n: Optional[int] = None,
    tokenizer_dir: Optional[str | Path] = None,
    chat_template: Optional[str] = None,
    processes: Optional[DistributedContext] = None,
) -> Path:
    """Write a complete checkpoint for ``state.progress.step`` (every rank calls this), then prune older ones.

    The Hugging Face files are written by rank 0 (a sharded model gathered one output shard at a time, so no
    rank holds the whole model), the recipe state by every rank (DCP: each rank its own shard), then the manifest
    (every rank hashing its share of the files), all into one temporary directory that rank 0 renames into place
    once every rank is done. Once the renamed checkpoint matches its manifest, older checkpoints are pruned (see
    the module docstring). ``optimizers`` is the optimizer, or the per-parameter optimizers of a step in
    backward: their state is saved by parameter name either way.

    Args:
        model: the model, whose parameters the recipe state holds.
        hf_files: the model's Hugging Face tensors and config.json (``torchtune_ac.models.hf_model_files``); None: a
            run with adapters that saves them alone (the tokenizer's files are still copied).
        state: where the run stands and what a resume checks (``trainer_state.json``).
        adapter_files: a run's adapters, written as a PEFT adapter folder (``checkpoint/peft.py``); None: none.
        merged_files: with ``adapter_files``, the merged model's Hugging Face files, written with the tokenizer's
            into the subfolder ``merged/`` (``MERGED_DIR``); None: none.
        keep_last_n: keep this many newest checkpoints whole and delete the others; None keeps every
            checkpoint's Hugging Face files and the recipe state of the newest ``RESUMABLE_KEPT``.
        tokenizer_dir: the tokenizer files to copy into the checkpoint.
        chat_template: the chat template the run's tokenizer used (None: none), saved with the tokenizer files.
        processes: the run's processes (None: this process alone).

    Returns:
        The checkpoint directory.

    Raises:
        UserError: a rank could not write its files (a full disk, a read-only file system, an I/O error), on every
            rank; the partial checkpoint is removed and nothing older is touched.
    """
    root = Path(output_dir)
    final = root / checkpoint_name(state.progress.step)
    if leads(processes):
        remove_debris(root)  # what a run killed while saving or pruning left behind
    if processes is not None:
        processes.barrier()  # before any rank writes there

    def write(tmp: Path) -> None:
        if hf_files is not None:
            run_on_every_rank(
                lambda: write_hf_files(hf_files, tmp, tokenizer_dir=tokenizer_dir, chat_template=chat_template,
                                       processes=processes),
                where=tmp, processes=processes,
            )
        elif tokenizer_dir is not None:
            run_on_every_rank(lambda: copy_tokenizer_files(tokenizer_dir, tmp, chat_template=chat_template)
                              if leads(processes) else None, where=tmp, processes=processes)
        if adapter_files is not None:
            run_on_every_rank(lambda: write_adapter_files(adapter_files, tmp, processes=processes), where=tmp,
                              processes=processes)
        if merged_files is not None:
            run_on_every_rank(lambda: _write_merged(merged_files, tmp / MERGED_DIR, tokenizer_dir=tokenizer_dir,
                                                    chat_template=chat_template, processes=processes),
                              where=tmp, processes=processes)
        run_on_every_rank(
            lambda: _save_recipe_state(tmp / RECIPE_STATE_DIR, model=model, optimizers=optimizers,
                                       state=state, processes=processes),
            where=tmp, processes=processes,
        )
        run_on_every_rank(lambda: write_manifest(tmp, processes=processes), where=tmp, processes=processes)  # last

    try:
        # overwrite: an earlier save of this very step (epoch end == save_every_n_steps) is replaced.
        write_directory(final, write, overwrite=True, processes=processes)
    except CollectiveStepFailed as err:
        if not err.failure.environmental:
            raise
        older = [c.name for c in list_checkpoints(root) if c != final]
        kept = f"the newest is still {older[-1]}" if older else "there is none yet"
        raise UserError(
            f"checkpoint {final} could not be written: rank {err.failure.rank}: {err.failure.message}; the partial "
            f"checkpoint was removed and no earlier checkpoint was touched ({kept}): make room, then run the same "
            "command with resume_from_checkpoint=true"
        ) from err
    run_on_every_rank(lambda: _prune(root, final, keep_last_n) if leads(processes) else None, where=root,
                      processes=processes)
    return final


def _write_merged(files: HFModelFiles, folder: Path, *, tokenizer_dir: Optional[str | Path],
                  chat_template: Optional[str], processes: Optional[DistributedContext]) -> None:
    folder.mkdir(exist_ok=True)  # every rank: on the shared file system, the same folder
    write_hf_files(files, folder, tokenizer_dir=tokenizer_dir, chat_template=chat_template, processes=processes)


def _prune(root: Path, final: Path, keep_last_n: Optional[int]) -> None:
    """Rank 0: check ``final`` against its manifest, point ``latest`` at it, then prune the older checkpoints (see
    the module docstring)."""
    problem = check_against_manifest(final, hashes=False, require=_TRAINER_STATE)
    if problem is not None:
        raise RuntimeError(f"the checkpoint just written does not match its manifest ({problem}); nothing pruned")
    _point_latest(root, final)
    newest_first = list(reversed(list_checkpoints(root)))
    for checkpoint in newest_first:
        if _checkpoint_step(checkpoint) > _checkpoint_step(final):
            discard_directory(checkpoint, root)  # a resumed run superseded it (it failed its manifest)
    older = [c for c in newest_first if _checkpoint_step(c) < _checkpoint_step(final)]
    keep_state = (keep_last_n if keep_last_n is not None else RESUMABLE_KEPT) - 1
    for i, checkpoint in enumerate(older):
        if keep_last_n is not None and i >= keep_last_n - 1:
            discard_directory(checkpoint, root)
        elif i >= keep_state and (checkpoint / RECIPE_STATE_DIR).exists():
            write_manifest_without(checkpoint, f"{RECIPE_STATE_DIR}/")
            discard_directory(checkpoint / RECIPE_STATE_DIR, root)


def _point_latest(root: Path, final: Path) -> None:
    """Point ``root/latest`` at ``final``.

    A folder there is a copy made through the link (``shutil.copytree``, ``cp -rL``): a stale duplicate of a
    checkpoint (it has a manifest), replaced; any other folder is not ours, and is left alone with a warning.
    """
    latest = root / LATEST_POINTER
    if latest.is_dir() and not latest.is_symlink():
        if not (latest / MANIFEST_FILE).is_file():
            log.warning("%s is a folder this run did not write; left alone, so it does not name %s", latest, final)
            return
        discard_directory(latest, root)
    write_pointer(latest, final.name)


def _save_recipe_state(
    state_dir: Path,
    *,
    model: nn.Module,
    optimizers: Sequence[torch.optim.Optimizer],
    state: RecipeState,
    processes: Optional[DistributedContext],
) -> None:
    """Model + optimizer through DCP (every rank its shard), each rank's RNG state; rank 0 trainer_state.json."""
    tensors = {"model": get_model_state_dict(model, options=TRAINED_ONLY),
               "optimizer": get_optimizer_state_dict(model, optimizers)}
    with _single_process_dcp_quiet():
        dcp.save(tensors, checkpoint_id=state_dir, no_dist=not together(processes))
    rank = processes.rank if processes is not None else 0
    rng = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        rng["cuda"] = torch.cuda.get_rng_state()
    torch.save(rng, state_dir / f"rng_rank{rank}.pt")
    if leads(processes):
        record = {"progress": asdict(state.progress), "shape": asdict(state.shape),
                  "hyperparameters": state.hyperparameters, "data": state.data}
        (state_dir / TRAINER_STATE_FILE).write_text(json.dumps(record, indent=2))


def read_trainer_state(checkpoint: Path) -> RecipeState:
    """What ``checkpoint`` records of its run.

    Raises:
        UserError: trainer_state.json is missing, not JSON, or not what this version writes (naming the file).
    """
    path = checkpoint / RECIPE_STATE_DIR / TRAINER_STATE_FILE
    data = read_json(path)
    try:
        # Checkpoints of earlier versions record neither the hyper-parameters nor the data: they still resume.
        return RecipeState(Progress(**data["progress"]), RunShape(**data["shape"]), data.get("hyperparameters"),
                            data.get("data"))
    except (KeyError, TypeError) as err:
        raise UserError(f"{path}: not a trainer state this version reads ({type(err).__name__}: {err}); a newer or "
                        "older torchtune_ac wrote it: train on from its weights with checkpoint_dir="
                        f"{checkpoint} in a new output_dir") from None


def check_resume_shape(checkpoint: Path, saved: RunShape, current: RunShape) -> None:
    """Refuse a resume that could not continue the same run.

    The number of processes, the batch size and the accumulation may change if the global batch does not (each
    step is then made of the same samples, and the loss of a step does not depend on how they are split).

    Raises:
        UserError: naming each setting that differs between the checkpoint and this run.
    """
    problems = []
    if saved.global_batch != current.global_batch:
        changed = [
            f"{name} was {getattr(saved, name)}, now {getattr(current, name)}"
            for name in ("batch_size", "gradient_accumulation_steps", "world_size", "tensor_parallel_dim")
            if getattr(saved, name) != getattr(current, name)
        ]
        problems.append(
            f"the global batch was {saved.describe_batch()}, now {current.describe_batch()} ({', '.join(changed)}): "
            "keep batch_size x gradient_accumulation_steps x processes / tensor_parallel_dim equal"
        )
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
        raise UserError(f"resume from {checkpoint}: cannot continue exactly: " + "; ".join(problems)
                        + f"; to train on from its weights instead, start a new run with checkpoint_dir={checkpoint} "
                        "and another output_dir")


def load_checkpoint(
    checkpoint: Path,
    *,
    model: nn.Module,
    optimizers: Sequence[torch.optim.Optimizer],
    processes: Optional[DistributedContext] = None,
) -> None:
    """Restore model, optimizer state and this rank's RNG state from ``checkpoint`` (every rank of ``processes``
    calls this; None: this process alone).

    The model and optimizer state are resharded by DCP to this run's number of processes. The optimizers keep the
    hyper-parameters they were built with (this run's config: learning rate, betas, weight decay, ...): only their
    state (moments, step counts) comes from the checkpoint. Each rank's RNG state belongs to its rank: on another
    world size, rank ``r`` takes that of rank ``r`` modulo the saved world size (dropout masks then differ from
    an uninterrupted run's; nothing else draws random numbers while training).
    """
    state_dir = checkpoint / RECIPE_STATE_DIR
    # Copied before the state dict is built: DCP loads a tensor-valued setting (torchao's lr) into it in place.
    built = [[_hyperparameters_of(group) for group in optimizer.param_groups] for optimizer in optimizers]
    state = {"model": get_model_state_dict(model, options=TRAINED_ONLY),
             "optimizer": get_optimizer_state_dict(model, optimizers)}
    with _single_process_dcp_quiet():
        dcp.load(state, checkpoint_id=state_dir, no_dist=not together(processes))
    set_model_state_dict(model, state["model"], options=TRAINED_ONLY)
    set_optimizer_state_dict(model, optimizers, state["optimizer"])
    for optimizer, groups in zip(optimizers, built):
        for group, hyperparameters in zip(optimizer.param_groups, groups, strict=True):
            # In place: the groups of the per-parameter optimizers of a step in backward are shared dicts.
            for key in [key for key in group if key not in _GROUP_MEMBERS and key not in hyperparameters]:
                del group[key]
            group.update(hyperparameters)
    rank = processes.rank if processes is not None else 0
    saved_ranks = len(list(state_dir.glob("rng_rank*.pt")))
    rng = torch.load(state_dir / f"rng_rank{rank % saved_ranks}.pt", weights_only=True)
    torch.set_rng_state(rng["cpu"])
    if "cuda" in rng:
        torch.cuda.set_rng_state(rng["cuda"])
    if processes is not None:
        processes.barrier()  # every rank has read the checkpoint before any goes on to write


def _hyperparameters_of(group: dict[str, Any]) -> dict[str, Any]:
    """A param group's settings (a copy; tensors cloned), without its parameters."""
    return {key: value.clone() if isinstance(value, torch.Tensor) else copy.deepcopy(value)
            for key, value in group.items() if key not in _GROUP_MEMBERS}
