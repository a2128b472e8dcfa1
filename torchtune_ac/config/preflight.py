"""Cheap start-up checks of a fine-tuning config, run before anything heavy (and by ``tune validate``).

Builds the model on the meta device (sizes, parameter count), resolves the activation-checkpointing plan,
and checks the files the run will read and write. Problems with the config itself, and files that exist and
contradict it, are always errors; what is missing or unavailable on this machine (``UnavailableError``: a file,
a device, a package) is an error when ``strict`` (about to run) and a warning otherwise (``tune validate`` on a
machine that is not the training machine). ``tune validate`` also reads the data as the run will
(``data.datasets.check_dataset_records``), and with ``from_hf_config`` and a checkpoint of another machine, whose
architecture it cannot read, it checks the rest and says so.

This is where the environment is checked (files, devices, what the components build); the config's types are
checked once by the schema (``validation.py``) and the memory switches' combinations once by the memory plan
(``memory/plan.py``). Two checks catch, before anything heavy, what would otherwise fail at step 1 or later:

- the tokenizer against the model: a tokenizer with more tokens than the model's vocabulary (or a special-token
  id beyond it) would make an embedding lookup index past the table at the first batch that holds such an id;
- the optimizer and the LR scheduler, built once on a stand-in parameter: an argument the class itself rejects
  (``optimizer.betas=[0.9]``) is reported naming the key at start-up, and by ``tune validate``, instead of after
  the model is built and sharded.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional

import torch

from torchtune_ac.checkpoint import (
    RunShape,
    check_resume_shape,
    check_writable_directory,
    choose_resume_checkpoint,
    list_checkpoints,
    read_lock,
    read_trainer_state,
)
from torchtune_ac.config.components import Component
from torchtune_ac.config.meta_model import build_meta_model, count_parameters
from torchtune_ac.config.planning import planning_inputs, resolve_config_plan, unmodelled_settings
from torchtune_ac.config.schema import FSDPConfig, FullFinetuneConfig
from torchtune_ac.data import uses_chat_template
from torchtune_ac.data.datasets import check_dataset_records
from torchtune_ac.data.hf_sources import describe_hub_source
from torchtune_ac.data.sources import TEXT_SUFFIXES, check_folder_formats, is_hub_name
from torchtune_ac.errors import UnavailableError, UserError
from torchtune_ac.memory.plan import MemoryPlan
from torchtune_ac.models import check_checkpoint_matches
from torchtune_ac.models.families import family_of, transformer_blocks
from torchtune_ac.observability.metrics import METRICS_FILE
from torchtune_ac.runtime.distributed import resolve_device

# A schedule built for the stand-in checks only: long enough for any warm-up a real run could ask for.
_STAND_IN_TRAINING_STEPS = 1_000_000


def check_tokenizer_fits(tokenizer: Component, vocab_size: Optional[int]) -> None:
    """Build the tokenizer and check its ids fit the model's vocabulary (``vocab_size``; None: unknown model).

    Raises:
        UnavailableError: the tokenizer's files are not on this machine.
        UserError: the tokenizer's files are broken, or it has more tokens, or a special-token id, beyond the
            model's vocabulary (naming the tokenizer file and both sizes).
    """
    built = tokenizer.instantiate()
    if vocab_size is None:
        return
    problems = []
    if built.vocab_size > vocab_size:
        problems.append(f"it has {built.vocab_size:,} tokens (ids up to {built.vocab_size - 1:,})")
    for name in ("bos", "eos", "pad"):
        token_id = getattr(built, f"{name}_id")
        if token_id is not None and token_id >= vocab_size and built.vocab_size <= vocab_size:
            problems.append(f"its {name} id is {token_id:,}")
    if problems:
        raise UserError(
            f"tokenizer {built.path}: {' and '.join(problems)}, but the model's vocabulary has {vocab_size:,} tokens "
            f"(ids 0 to {vocab_size - 1:,}): such an id would index past the embedding table; use the tokenizer "
            "that belongs to the model's checkpoint, or a model whose vocab_size covers it"
        )


def check_chat_template(tokenizer: Component, dataset: Component) -> None:
    """Refuse chat data with a tokenizer that has no chat template (a dataset rendered with a chat template needs
    a tokenizer that has one, or a ``tokenizer.chat_template`` naming one, or the run would stop only once the
    model is built).

    Raises:
        UserError: the dataset renders chat and the tokenizer has no template (naming the tokenizer folder and how
            to name a template).
    """
    if not uses_chat_template(dataset.target(), dataset.kwargs):
        return
    try:
        built = tokenizer.instantiate()
    except UnavailableError:
        return  # not on this machine: check_tokenizer_fits says so
    try:
        built.require_chat_template()
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


@dataclass
class PreflightReport:
    """What the checks found: summary lines for the user, warnings, and the resolved memory plan (AC included)."""

    summary: list[tuple[str, str]] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    plan: Optional[MemoryPlan] = None
    n_parameters: int = 0


def model_architecture(model: torch.nn.Module) -> dict:
    """What defines a model's weights, as its family's adapter says (empty for a model of no known family)."""
    family = family_of(model)
    return {} if family is None else family.hf.architecture(family.args_of(model))


def run_shape(cfg: FullFinetuneConfig, world_size: int, model: torch.nn.Module, plan: MemoryPlan) -> RunShape:
    """What a resume of this run must keep (see ``RunShape``), with what the memory switches say of theirs, and
    the optimizer's class (another one cannot take its state)."""
    data = {
        "optimizer._component_": cfg.optimizer.path,
        "seed": cfg.seed,
        "shuffle": cfg.shuffle,
        "max_seq_len": cfg.max_seq_len,
        # Not its source: the files are identified by their content (TrainerState.data), wherever they lie.
        "dataset": {key: value for key, value in cfg.dataset.as_config().items() if key != "source"},
        "tokenizer": cfg.tokenizer.as_config(),
    }
    data.update(plan.resume_record())
    # As it reads back from trainer_state.json (tuples become lists), so a resume compares like with like.
    data, architecture = json.loads(json.dumps([data, model_architecture(model)]))
    return RunShape(world_size, cfg.batch_size, cfg.gradient_accumulation_steps, architecture, data)


def run_hyperparameters(cfg: FullFinetuneConfig) -> dict[str, Any]:
    """The optimizer and schedule settings a checkpoint records (``TrainerState.hyperparameters``), as JSON values;
    a resume takes its own config's and says what changed."""
    sections = {"optimizer": cfg.optimizer.as_config(),
                "lr_scheduler": cfg.lr_scheduler.as_config() if cfg.lr_scheduler is not None else None}
    return json.loads(json.dumps(sections))


def describe_sharding(cfg: FullFinetuneConfig, world_size: Optional[int], plan: MemoryPlan) -> str:
    """How FSDP2 shards the run's model and reduces its gradients, as resolved (``tune validate``, the run's log)."""
    if world_size == 1 and not plan.shard_options():
        return "not sharded (1 process)"
    reduce = cfg.fsdp.resolved_reduce_dtype(cfg.dtype).value
    reduce += " (dtype)" if cfg.fsdp.reduce_dtype is None else ""
    replicas = cfg.fsdp.replicate_degree
    if world_size is None:
        layout = ("sharded over every process" if replicas == 1
                  else f"HSDP: {replicas} replicas, each sharded over world size / {replicas}")
    elif replicas == 1:
        layout = f"sharded over {world_size} process(es)"
    else:
        layout = f"HSDP: {replicas} replicas x {cfg.fsdp.shard_degree(world_size)} shards"
    return f"{layout}; gradients reduced in {reduce}"


def _check_output_dir(cfg: FullFinetuneConfig, strict: bool) -> None:
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


def _resolve_plan(cfg: FullFinetuneConfig, model: torch.nn.Module, world_size: Optional[int], strict: bool,
                  report: PreflightReport) -> MemoryPlan:
    """The memory plan; with ``ac_mode: auto``, the planner's choice for this world size (1 when unknown)."""
    planning = None
    if cfg.ac.is_auto:
        try:
            device = resolve_device(cfg.device.value)
        except UserError:
            if strict or cfg.ac.ac_memory_budget_gib is None:
                raise UserError(
                    f"ac_mode=auto with device={cfg.device.value}: the budget cannot be read on this machine; set "
                    "ac_memory_budget_gib to plan here"
                ) from None
            device = torch.device("cpu")  # validating elsewhere: the given budget is all the planner needs
        if world_size is None:
            report.warnings.append("ac_mode=auto: planned for 1 process (the launch's world size is not known here)")
        planning = planning_inputs(cfg, world_size or 1, device)
        report.warnings.extend(f"ac_mode=auto: {note}" for note in unmodelled_settings(cfg, world_size or 1))
    return resolve_config_plan(cfg, model, cfg.ac, planning)


def _check_plan_device(cfg: FullFinetuneConfig, plan: MemoryPlan) -> None:
    """The switches against the device this machine gives the run (a device it lacks is reported on its own)."""
    try:
        device = resolve_device(cfg.device.value)
    except UnavailableError:
        return
    plan.check_device(device)


def preflight_full_finetune(cfg: FullFinetuneConfig, *, strict: bool, world_size: Optional[int] = 1) -> PreflightReport:
    """Run the start-up checks.

    Args:
        cfg: the validated config.
        strict: file-system and device problems are errors (True) or warnings (False).
        world_size: number of processes the run will use (for the resume checks); None when unknown (an
            elastic node range), which skips the world-size comparison.

    Raises:
        UserError: the first problem found (config problems and contradicting files always; what is missing on
            this machine when ``strict``).
    """
    report = PreflightReport()

    def soft(check: Callable[[], None]) -> None:
        try:
            check()
        except UnavailableError as err:
            if strict:
                raise
            report.warnings.append(str(err))

    if world_size is not None:
        cfg.fsdp.shard_degree(world_size)  # whole HSDP rows, before anything is built
    model = _build_meta_model(cfg, strict, report)
    soft(lambda: resolve_device(cfg.device.value))
    if model is not None:
        report.n_parameters = count_parameters(model)
        report.plan = _resolve_plan(cfg, model, world_size, strict, report)
        soft(lambda: _check_plan_device(cfg, report.plan))
        if cfg.checkpoint_dir is not None:
            soft(lambda: check_checkpoint_matches(model, cfg.checkpoint_dir))
    soft(lambda: check_tokenizer_fits(cfg.tokenizer, report.plan.vocab_size if report.plan is not None else None))
    soft(lambda: check_chat_template(cfg.tokenizer, cfg.dataset))
    if cfg.dataset_val is not None:
        soft(lambda: check_chat_template(cfg.tokenizer, cfg.dataset_val))
    check_optimizer_builds(cfg.optimizer, cfg.lr_scheduler)
    for dataset in (cfg.dataset, cfg.dataset_val):
        if dataset is not None:
            check_folder_formats(dataset.kwargs.get("source"))
    soft(lambda: _check_output_dir(cfg, strict))
    resume_note = ""
    if cfg.resume_from_checkpoint:
        # Sizes against each checkpoint's manifest here; the run itself also checks every file's SHA-256.
        choice = choose_resume_checkpoint(Path(cfg.output_dir).expanduser(), hashes=False)
        report.warnings.extend(choice.skipped)
        if choice.checkpoint is not None:
            if model is not None:
                saved = read_trainer_state(choice.checkpoint).shape
                current = run_shape(cfg, saved.world_size if world_size is None else world_size, model, report.plan)
                check_resume_shape(choice.checkpoint, saved, current)
            resume_note = f" (resuming from {choice.checkpoint.name})"
        else:
            resume_note = " (resume_from_checkpoint=true, but no checkpoint yet: starts at step 0)"

    if cfg.metric_logger is not None:
        # Building the tracker only checks its settings; its package is needed on the machine that trains.
        soft(cfg.metric_logger.instantiate().check_available)

    family = family_of(model) if model is not None else None
    context = getattr(family.args_of(model), "max_seq_len", None) if family is not None else None
    if cfg.max_seq_len is not None and context is not None and cfg.max_seq_len > context:
        # Positions are computed as needed, so nothing fails: longer samples just meet positions never trained.
        report.warnings.append(
            f"max_seq_len={cfg.max_seq_len}: samples may be longer than the model's context ({context} positions, "
            f"{cfg.model.path}); if you extend it on purpose, say so with model.max_seq_len={cfg.max_seq_len}"
        )

    if cfg.dataset_val is None:
        for key in ("run_val_every_n_steps", "batch_size_val"):
            if getattr(cfg, key) is not None:
                raise UserError(f"{key}={getattr(cfg, key)}: only used with dataset_val; set dataset_val (a dataset "
                                f"component, like dataset) or remove {key}")

    hub_source = None
    source = cfg.dataset.kwargs.get("source")
    if not strict and isinstance(source, str) and is_hub_name(source, TEXT_SUFFIXES):
        # tune validate: the data is read when the run starts; say whether it will be downloaded or read from the
        # cache, and whether offline mode leaves it nothing to read.
        hub_source, warning = describe_hub_source(source)
        if warning is not None:
            report.warnings.append(warning)
    data_lines = []
    if not strict:  # tune validate reads the data; a run reads it once, when it builds the dataset
        for dataset in (cfg.dataset, cfg.dataset_val):
            checked = None if dataset is None else _check_data(cfg, dataset, soft)
            if checked is not None:
                summary, data_report = checked
                data_lines.append((dataset.key, summary))
                report.warnings.extend([data_report] if data_report else [])

    if (world_size == 1 and cfg.fsdp != FSDPConfig() and report.plan is not None
            and not report.plan.shard_options()):
        report.warnings.append("fsdp.*: these settings apply only when the run has more than one process (FSDP2)")

    per_step = cfg.batch_size * cfg.gradient_accumulation_steps
    if model is not None:
        model_lines = [("model", f"{cfg.model.path}: {report.n_parameters:,} parameters, "
                                 f"{len(transformer_blocks(model))} layers"),
                       *report.plan.describe(),
                       ("dtype / device", f"{cfg.dtype.value} / {cfg.device.value}"),
                       ("fsdp", describe_sharding(cfg, world_size, report.plan))]
    else:
        model_lines = [("model", f"{cfg.model.path}: its architecture is read from checkpoint_dir when the run "
                                 "starts (not on this machine: sizes and memory plan not checked)"),
                       ("dtype / device", f"{cfg.dtype.value} / {cfg.device.value}")]
    report.summary = [
        *model_lines,
        (
            "batch",
            f"{cfg.batch_size} per process x {cfg.gradient_accumulation_steps} accumulation step(s)"
            f" = {per_step} samples per step per process",
        ),
        ("checkpoint_dir", cfg.checkpoint_dir or "none (random initialisation from seed)"),
        ("output_dir", cfg.output_dir + resume_note),
        *([("dataset source", hub_source)] if hub_source is not None else []),
        *data_lines,
    ]
    return report


def _build_meta_model(cfg: FullFinetuneConfig, strict: bool, report: PreflightReport) -> Optional[torch.nn.Module]:
    """The model on the meta device; None for ``tune validate`` on a machine that lacks what its architecture is
    read from (``from_hf_config`` and a ``checkpoint_dir`` of another machine), with a warning saying so.

    Raises:
        UserError: the model cannot be built (when ``strict``, also for what is missing on this machine).
    """
    try:
        return build_meta_model(cfg.model, cfg.checkpoint_dir)
    except UnavailableError as err:
        if strict:
            raise
        report.warnings.append(f"model ({cfg.model.path}): {err}: its size, memory plan and checkpoint are checked "
                               "on the machine that has it")
        return None


def _check_data(cfg: FullFinetuneConfig, dataset: Component,
                soft: Callable[[Callable[[], None]], None]) -> Optional[tuple[str, Optional[str]]]:
    """``tune validate``'s look at ``dataset``'s records (``check_dataset_records``): a summary line and what
    building the samples would cut or drop; None when there is nothing to read here (a Hub dataset, which is not
    downloaded to validate; a tokenizer or data file of another machine, which ``soft`` turns into a warning)."""
    source = dataset.kwargs.get("source")
    sources = source if isinstance(source, list) else [source]
    if any(isinstance(one, str) and is_hub_name(one, TEXT_SUFFIXES) for one in sources):
        return None
    try:
        tokenizer = cfg.tokenizer.instantiate()
    except UnavailableError:
        return None  # check_tokenizer_fits says so
    checked: list[tuple[str, Optional[str]]] = []

    def check() -> None:
        found = check_dataset_records(dataset.target(), tokenizer, dataset.kwargs, cfg.max_seq_len)
        if found is not None:
            checked.append(found)

    soft(check)
    return checked[0] if checked else None
