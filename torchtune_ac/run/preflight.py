"""What ``tune validate``, ``tune plan`` and the launcher of ``tune run --nproc_per_node N`` ask of a recipe, for
any recipe whose config has the run layer's keys (``plan.RunConfig``): the same ``RunPlan`` a run resolves,
printed; and the few checks the launcher makes before it starts the processes.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import torch

from torchtune_ac.config.meta_model import build_meta_model
from torchtune_ac.errors import UnavailableError, UserError
from torchtune_ac.run.checks import Findings, check_run
from torchtune_ac.run.memory_table import MemoryTable, memory_table
from torchtune_ac.run.messages import length_warnings
from torchtune_ac.run.length import RunLength
from torchtune_ac.run.plan import RunConfig, RunPlan, resolve_parallelism, resolve_run_plan


def preflight(cfg: RunConfig, *, strict: bool = True, world_size: Optional[int] = 1) -> list[tuple[str, str]]:
    """The run's plan for ``world_size`` processes (None: not known) and what the checks found, as summary lines:
    ``tune validate`` prints them (``strict=False``: what is missing on this machine is a warning).

    Raises:
        UserError: the config cannot run (and, when ``strict``, what is missing here).
    """
    try:
        model = build_meta_model(cfg.model, cfg.checkpoint_dir)  # the one meta build
    except UnavailableError as err:
        if strict:
            raise
        # from_hf_config and a checkpoint of another machine: no architecture here, so no plan; the rest is checked.
        found = check_run(cfg, None, None, strict=strict)
        found.warnings.insert(0, f"model ({cfg.model.path}): {err}: its size, memory plan and checkpoint are checked "
                                 "on the machine that has it")
        return summary(None, found, cfg)
    plan = resolve_run_plan(cfg, model, world_size=world_size)
    return summary(plan, check_run(cfg, plan, model, strict=strict), cfg)


def summary(plan: Optional[RunPlan], found: Findings, cfg: RunConfig) -> list[tuple[str, str]]:
    """The plan's lines, with what the checks add (the checkpoint a resume would start from, a hub dataset's
    source, what reading the data found), then the warnings: the plan's notes and the checks'. Without a plan
    (no architecture on this machine), the lines the config alone gives."""
    if plan is None:
        lines = [("model", f"{cfg.model.path}: its architecture is read from checkpoint_dir when the run starts (not "
                           "on this machine: sizes and memory plan not checked)"),
                 ("dtype / device", f"{cfg.dtype.value} / {cfg.device.value}"),
                 ("batch", f"{cfg.batch_size} per process x {cfg.gradient_accumulation_steps} accumulation step(s) = "
                           f"{cfg.batch_size * cfg.gradient_accumulation_steps} samples per step per process"),
                 ("checkpoint_dir", cfg.checkpoint_dir or "none (random initialisation from seed)"),
                 ("output_dir", cfg.output_dir)]
    else:
        lines = plan.describe()
    lines = [(label, value + found.resume_note if label == "output_dir" else value) for label, value in lines]
    if found.dataset_source is not None:
        lines.append(("dataset source", found.dataset_source))
    lines += found.data
    notes = (*plan.notes, *length_warnings(_length_bound(plan, found), plan.hyperparameters)) if plan is not None else ()
    return lines + [("warning", w) for w in (*notes, *found.warnings)]


def _length_bound(plan: RunPlan, found: Findings) -> RunLength:
    """The plan's length, counted from the samples ``tune validate`` made, as on one process (the most steps any
    number of processes gives them: ``length_warnings`` then speaks of "at most")."""
    length = plan.length
    if found.samples is None or length.steps_per_epoch is not None:
        return length
    try:
        return length.counted(found.samples, found.samples // length.batch_size)
    except UserError:  # too few samples for one step: the run says so, naming its processes
        return length


def plan(cfg: RunConfig, *, world_size: Optional[int], budget_gib: Optional[float]) -> MemoryTable:
    """``tune plan``: the run's plan and the memory per process of every AC setting for its step (``world_size``
    None: the fewest processes the config's parallel degrees run on, said in the title; ``budget_gib`` None: the
    config's ``ac_memory_budget_gib``)."""
    budget = budget_gib if budget_gib is not None else cfg.ac.ac_memory_budget_gib
    if world_size is not None:
        return memory_table(cfg, world_size=world_size, budget_gib=budget)
    degrees = resolve_parallelism(cfg, None, None)
    table = memory_table(cfg, world_size=degrees.fewest_processes, budget_gib=budget)
    if degrees.fewest_processes == 1:
        return table
    return dataclasses.replace(table, title=f"{table.title} (--nproc not given: planned for "
                                            f"{degrees.fewest_processes} processes, the fewest for "
                                            f"{degrees.describe_degrees()}; pass --nproc for another count)")


def check_launch(cfg: RunConfig, *, world_size: Optional[int], nproc_per_node: int) -> None:
    """What the launcher checks before it starts ``nproc_per_node`` processes per node (``world_size`` in all; None
    for an elastic range): only what the processes would report differently from one another, or each on its own.
    Everything else each rank reports the same, once (rank 0 resolves and checks the plan for all).

    Raises:
        UserError: the world size is not whole HSDP rows of whole tensor-parallel groups, or a CUDA run has more processes per node than the node
            has visible GPUs (ranks past the last GPU would each fail on their own).
    """
    resolve_parallelism(cfg, None, world_size)  # the run's own check of the degrees against the world size
    if cfg.device.value in ("cuda", "auto") and torch.cuda.is_available():
        visible = torch.cuda.device_count()
        if nproc_per_node > visible:
            raise UserError(
                f"--nproc_per_node {nproc_per_node}: this node has {visible} visible GPU(s) for device="
                f"{cfg.device.value}: start at most {visible} processes per node (one per GPU), or set device=cpu"
            )
