"""What a run's plan is checked against before anything heavy: the machine and the files (``tune validate``, and
rank 0 of ``tune run`` as it resolves the plan).

The config's types are checked once by the schema (``config/validation.py``) and the combination of its keys once
by resolving the plan (``plan.py``); this module checks what the plan meets here: the device, the files the run
will read and write, and what the components build. Problems of the config itself, and files that exist and
contradict it, are always errors; what is missing or unavailable on this machine (``UnavailableError``: a file, a
device, a package) is an error when ``strict`` (about to run) and a warning otherwise (``tune validate`` on a
machine that is not the training machine). ``tune validate`` also reads the data as the run will
(``data.datasets.check_dataset_records``), and with ``from_hf_config`` and a checkpoint of another machine, whose
architecture it cannot read (no plan then), it checks the rest and says so.

Two checks catch, before anything heavy, what would otherwise fail at step 1 or later:

- the tokenizer against the model: a tokenizer with more tokens than the model's vocabulary (or a special-token
  id beyond it) would make an embedding lookup index past the table at the first batch that holds such an id;
- the optimizer and the LR scheduler, built once on a stand-in parameter: an argument the class itself rejects
  (``optimizer.betas=[0.9]``) is reported naming the key at start-up, and by ``tune validate``, instead of after
  the model is built and sharded.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional

import torch
from torch import nn

from torchtune_ac.checkpoint import (
    check_resume_shape,
    check_writable_directory,
    choose_resume_checkpoint,
    list_checkpoints,
    read_lock,
    read_trainer_state,
)
from torchtune_ac.config.components import Component
from torchtune_ac.data import uses_chat_template
from torchtune_ac.data.datasets import check_dataset_records
from torchtune_ac.data.hf_sources import describe_hub_source
from torchtune_ac.data.sources import TEXT_SUFFIXES, check_folder_formats, is_hub_name
from torchtune_ac.errors import UnavailableError, UserError
from torchtune_ac.models import check_checkpoint_matches, check_checkpoint_tensors
from torchtune_ac.models.vision.checks import check_model_takes_images
from torchtune_ac.observability.metrics import METRICS_FILE
from torchtune_ac.run.messages import naming_dataset_val
from torchtune_ac.run.plan import RunConfig, RunPlan
from torchtune_ac.runtime.distributed import resolve_device

# A schedule built for the stand-in checks only: long enough for any warm-up a real run could ask for.
_STAND_IN_TRAINING_STEPS = 1_000_000


def check_tokenizer_fits(tokenizer: Any, vocab_size: Optional[int]) -> None:
    """Check the tokenizer's ids fit the model's vocabulary (``vocab_size``; None: unknown model).

    Raises:
        UserError: it has more tokens, or a special-token id, beyond the model's vocabulary (naming the tokenizer
            file and both sizes).
    """
    if vocab_size is None:
        return
    problems = []
    if tokenizer.vocab_size > vocab_size:
        problems.append(f"it has {tokenizer.vocab_size:,} tokens (ids up to {tokenizer.vocab_size - 1:,})")
    for name in ("bos", "eos", "pad"):
        token_id = getattr(tokenizer, f"{name}_id")
        if token_id is not None and token_id >= vocab_size and tokenizer.vocab_size <= vocab_size:
            problems.append(f"its {name} id is {token_id:,}")
    if problems:
        raise UserError(
            f"tokenizer {tokenizer.path}: {' and '.join(problems)}, but the model's vocabulary has {vocab_size:,} "
            f"tokens (ids 0 to {vocab_size - 1:,}): such an id would index past the embedding table; use the tokenizer "
            "that belongs to the model's checkpoint, or a model whose vocab_size covers it"
        )


def check_chat_template(tokenizer: Any, dataset: Component) -> None:
    """Refuse chat data with a tokenizer that has no chat template (a dataset rendered with a chat template needs a
    tokenizer that has one, or a ``tokenizer.chat_template`` naming one, or the run would stop only once the model
    is built).

    Raises:
        UserError: the dataset renders chat and the tokenizer has no template (naming the tokenizer folder and how
            to name a template).
    """
    if not uses_chat_template(dataset.target(), dataset.kwargs):
        return
    try:
        tokenizer.require_chat_template()
    except UserError as err:
        raise UserError(f"{dataset.key}: {err}") from None


def check_optimizer_builds(optimizer: Component, lr_scheduler: Optional[Component]) -> None:
    """Build the optimizer on one stand-in parameter, and the LR scheduler on that optimizer.

    Raises:
        UserError: either rejected its arguments (naming the key, the class and the arguments).
    """
    stand_in = torch.nn.Parameter(torch.zeros(1))
    built = optimizer.instantiate([stand_in])
    if lr_scheduler is not None:
        lr_scheduler.instantiate(built, num_training_steps=_STAND_IN_TRAINING_STEPS)


def check_output_dir(cfg: RunConfig, strict: bool) -> None:
    """``output_dir`` can be written, is not inside ``checkpoint_dir``, and holds no earlier run unless resuming;
    ``tune validate`` also says whether a run holds its lock.

    Raises:
        UserError: one of those, naming the directory (what this machine cannot tell: ``UnavailableError``).
    """
    out = Path(cfg.output_dir).expanduser().resolve()
    if out.exists() and not out.is_dir():
        raise UserError(f"output_dir {out}: exists and is not a directory")
    if cfg.checkpoint_dir is not None:
        base = Path(cfg.checkpoint_dir).expanduser().resolve()
        if out == base or base in out.parents:
            raise UserError(f"output_dir {out}: must not be inside checkpoint_dir {base} (it is never modified)")
    check_writable_directory(out, "output_dir")
    if not cfg.resume_from_checkpoint and (list_checkpoints(out) or (out / METRICS_FILE).exists()):
        raise UserError(
            f"output_dir {out}: holds checkpoints or metrics of an earlier run; pass resume_from_checkpoint=true "
            "to continue it, or choose another output_dir"
        )
    if not strict:  # tune validate (a run checks once it holds the lock itself)
        try:
            holder = read_lock(out)
        except UserError as err:
            raise UnavailableError(str(err)) from None
        if holder is not None:
            now = "a run started now takes it over" if holder.is_stale_here() else "a run started now is refused"
            raise UnavailableError(f"output_dir {out}: locked by a run ({holder.describe()}): {now}")


@dataclass
class Findings:
    """What the checks found: warnings (what is missing on this machine, when not ``strict``), and lines that add
    to the plan's summary (``tune validate``): the checkpoint a resume starts from, a hub dataset's source, and
    ``(dataset key, summary)`` of each dataset read."""

    warnings: list[str] = field(default_factory=list)
    resume_note: str = ""
    dataset_source: Optional[str] = None
    data: list[tuple[str, str]] = field(default_factory=list)
    tokenizer: Any = None  # the tokenizer, when it could be built here
    samples: Optional[int] = None  # the training samples (rows, when packed), when every record was encoded


def check_run(cfg: RunConfig, plan: Optional[RunPlan], model: Optional[nn.Module], *, strict: bool,
              tokenizer: Any = None) -> Findings:
    """Check ``plan`` against this machine and the files (see the module docstring).

    Args:
        cfg: the validated config.
        plan: the resolved plan (None: ``tune validate`` without the model's architecture on this machine).
        model: the model, built once on the meta device (None with ``plan``).
        strict: what is missing on this machine is an error (True: about to run) or a warning.
        tokenizer: the run's tokenizer, when it built it already (otherwise it is built here, once).

    Raises:
        UserError: the first problem found (config problems and contradicting files always; what is missing on
            this machine when ``strict``).
    """
    found = Findings(tokenizer=tokenizer)

    def soft(check: Callable[[], Any]) -> Any:
        try:
            return check()
        except UnavailableError as err:
            if strict:
                raise
            found.warnings.append(str(err))
            return None

    device = soft(lambda: resolve_device(cfg.device.value))
    if device is not None and plan is not None:
        soft(lambda: plan.memory.check_device(device))
    if cfg.checkpoint_dir is not None and model is not None:
        soft(lambda: check_checkpoint_matches(model, cfg.checkpoint_dir))
    if found.tokenizer is None:
        found.tokenizer = soft(cfg.tokenizer.instantiate)
    if found.tokenizer is not None:
        check_tokenizer_fits(found.tokenizer, plan.model.vocab_size if plan is not None else None)
        check_chat_template(found.tokenizer, cfg.dataset)
        if cfg.dataset_val is not None:
            check_chat_template(found.tokenizer, cfg.dataset_val)
    check_optimizer_builds(cfg.optimizer, cfg.lr_scheduler)
    for dataset in (cfg.dataset, cfg.dataset_val):
        if dataset is not None:
            check_folder_formats(dataset.kwargs.get("source"))
    soft(lambda: check_output_dir(cfg, strict))
    resumes = False  # from a checkpoint of output_dir, whose weights the run loads, not checkpoint_dir's
    if cfg.resume_from_checkpoint:
        # Sizes against each checkpoint's manifest here; the run itself also checks every file's SHA-256.
        choice = choose_resume_checkpoint(Path(cfg.output_dir).expanduser(), hashes=False)
        found.warnings.extend(choice.skipped)
        if choice.checkpoint is not None:
            if plan is not None:
                saved = read_trainer_state(choice.checkpoint).shape
                check_resume_shape(choice.checkpoint, saved, plan.resume_shape(plan.world_size or saved.world_size))
            found.resume_note = f" (resuming from {choice.checkpoint.name})"
            resumes = True
        else:
            found.resume_note = " (resume_from_checkpoint=true, but no checkpoint yet: starts at step 0)"
    if not strict and cfg.checkpoint_dir is not None and model is not None and not resumes:
        # tune validate: the headers loading reads first (a run reads them as it loads, before training).
        soft(lambda: check_weights_readable(cfg.checkpoint_dir, model))
    if cfg.metric_logger is not None:
        # Building the tracker only checks its settings; its package is needed on the machine that trains.
        soft(cfg.metric_logger.instantiate().check_available)
    source = cfg.dataset.kwargs.get("source")
    if not strict and isinstance(source, str) and is_hub_name(source, TEXT_SUFFIXES):
        # tune validate: the data is read when the run starts; say whether it will be downloaded or read from the
        # cache, and whether offline mode leaves it nothing to read.
        found.dataset_source, warning = describe_hub_source(source)
        if warning is not None:
            found.warnings.append(warning)
    if not strict and found.tokenizer is None:  # no tokenizer here to encode the data: say at least if it is here
        for dataset in (cfg.dataset, cfg.dataset_val):
            if dataset is not None:
                soft(lambda dataset=dataset: _check_sources_exist(dataset))
    if not strict and found.tokenizer is not None:  # tune validate reads the data; a run reads it once, to train
        for dataset in (cfg.dataset, cfg.dataset_val):
            checked = None if dataset is None else _check_data(cfg, dataset, found.tokenizer, soft,
                                                               model if dataset is cfg.dataset else None)
            if checked is not None:
                summary, data_report, samples = checked
                found.data.append((dataset.key, summary))
                if dataset is cfg.dataset:
                    found.samples = samples
                found.warnings.extend([data_report] if data_report else [])
    return found


def check_weights_readable(checkpoint_dir: str, model: nn.Module) -> None:
    """Check the headers of ``checkpoint_dir``'s weights against ``model`` (on the meta device) as loading them does
    first (``check_checkpoint_tensors``: the files' length, every tensor's name, shape and dtype; a truncated file,
    a missing tensor or experts the files do not hold are refused here, in the run's words, not after the model is
    built), reading no weight; a folder that is not here is left to the check of its config.json.

    Raises:
        UnavailableError: the folder has no weights.
        UserError: only pickled weights, a file, index or shard that cannot be read, or tensors that do not fit
            the model.
    """
    folder = Path(checkpoint_dir).expanduser()
    if folder.is_dir():
        check_checkpoint_tensors(model, checkpoint_dir)


def _check_sources_exist(dataset: Component) -> None:
    """Refuse a local source of ``dataset`` that does not exist (not a Hub dataset's name).

    Raises:
        UnavailableError: naming the source (and ``dataset_val`` for the validation data).
    """
    source = dataset.kwargs.get("source")
    for one in source if isinstance(source, list) else [source]:
        if isinstance(one, str) and not is_hub_name(one, TEXT_SUFFIXES) and not Path(one).expanduser().exists():
            missing = UnavailableError(f"dataset source {one} does not exist")
            raise naming_dataset_val(missing) if dataset.key == "dataset_val" else missing


def _check_data(cfg: RunConfig, dataset: Component, tokenizer: Any, soft: Callable[[Callable[[], Any]], Any],
                model: Optional[nn.Module] = None) -> Optional[tuple[str, Optional[str], Optional[int]]]:
    """``tune validate``'s look at ``dataset``'s records (``check_dataset_records``; the first sample's images
    against ``model``'s tower, as the run checks them): a summary line, what building the samples would cut or
    drop, and how many samples they make; None when there is nothing to read here (a Hub dataset, which is not
    downloaded to validate; a data file of another machine, which ``soft`` turns into a warning)."""
    source = dataset.kwargs.get("source")
    sources = source if isinstance(source, list) else [source]
    if any(isinstance(one, str) and is_hub_name(one, TEXT_SUFFIXES) for one in sources):
        return None
    def check() -> Optional[tuple[str, Optional[str], Optional[int]]]:
        try:
            return check_dataset_records(
                dataset.target(), tokenizer, dataset.kwargs, cfg.max_seq_len,
                None if model is None else lambda sample: check_model_takes_images(model, sample, dataset.key))
        except UserError as err:
            raise naming_dataset_val(err) if dataset.key == "dataset_val" else err from None

    return soft(check)
