"""A config's memory plan: what ``ac_mode: auto`` and ``tune plan`` estimate, built from the config's keys.

The estimates themselves come from ``torchtune_ac.memory.planner`` (a simulated step under fake tensors);
this module turns a training config (any recipe's whose config has the keys of ``TrainingWorkload``) into the
planner's inputs, lays the estimates out as a table, and draws them. A recipe declares that ``tune plan`` can
answer for it by defining ``plan`` (see ``torchtune_ac/registry.py``'s ``PlannedRecipe``).
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional, Protocol

import torch

from torchtune_ac.config.components import Component
from torchtune_ac.config.meta_model import build_meta_model
from torchtune_ac.config.schema import Device
from torchtune_ac.errors import UnavailableError, UserError
from torchtune_ac.memory.activation_checkpointing import ACConfig
from torchtune_ac.memory.plan import MemoryPlan, PlanningInputs, resolve_memory_plan
from torchtune_ac.memory.planner import (
    GiB,
    MemoryEstimate,
    Workload,
    candidate_plans,
    describe_setting,
    estimate_memory,
    switch_ablation,
)
from torchtune_ac.memory.switch import OptimizerSpec
from torchtune_ac.models.families import transformer_blocks
from torchtune_ac.runtime.distributed import FSDPConfig
from torchtune_ac.runtime.dtypes import DType
from torchtune_ac.runtime.process_memory import ASSUMED_CUDA_FIXED_BYTES, CPU_STEP_RUNTIME_BYTES, fixed_bytes

ASSUMPTIONS = (
    "every row is max_seq_len tokens and every position a target (the loss's worst case); parameters compute in "
    "their storage dtype; the caching allocator's fragmentation is not included: on CUDA, device compares with "
    "max_memory_reserved plus the context; on a CPU, with the peak resident set of a run with ac_mode: auto, which "
    "has glibc map each tensor on its own so that its resident memory follows its tensors (other CPU runs leave "
    "glibc as it is, for speed, and peak higher: the pages of freed tensors stay resident)"
)


class TrainingWorkload(Protocol):
    """The config keys a training step's memory depends on: what a recipe's config must have for the planner."""

    model: Component
    optimizer: Component
    dataset: Component
    checkpoint_dir: Optional[str]
    device: Device
    batch_size: int
    max_seq_len: Optional[int]
    gradient_accumulation_steps: int
    clip_grad_norm: Optional[float]
    dtype: DType
    fsdp: FSDPConfig
    ac: ACConfig
    memory: Any  # MemoryConfig: the other memory switches' keys


def resolve_config_plan(cfg: TrainingWorkload, model: torch.nn.Module, ac: ACConfig,
                        planning: Optional[PlanningInputs] = None) -> MemoryPlan:
    """The memory plan of ``cfg``'s switches for ``model``, with ``ac`` as its AC keys (see ``resolve_memory_plan``).

    Raises:
        UserError: as ``resolve_memory_plan``.
    """
    return resolve_memory_plan(ac, cfg.memory, model, clip_grad_norm=cfg.clip_grad_norm, planning=planning,
                               fsdp=cfg.fsdp, optimizer=OptimizerSpec(cfg.optimizer.path, dict(cfg.optimizer.kwargs)),
                               dtype=cfg.dtype.torch, device=cfg.device.value)


def planned_device(device: Device) -> torch.device:
    """The device a run with ``device`` trains on, as far as planning goes: ``auto`` is CUDA where this machine has
    it; ``cuda`` is CUDA whether or not this machine has it (a plan for another machine)."""
    kind = device.value if device is not Device.AUTO else ("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(kind)


def process_fixed_bytes(device: Device) -> tuple[int, str]:
    """The fixed cost of a process of a run on ``device`` (see ``MemoryEstimate.device``), as this machine can
    tell: measured in this process when this machine has that device, else assumed; and which of the two, in
    words."""
    if planned_device(device).type == "cpu":
        return (fixed_bytes(torch.device("cpu")) + CPU_STEP_RUNTIME_BYTES,
                "measured: this process's resident set before the model, and "
                f"{CPU_STEP_RUNTIME_BYTES / GiB:.2f} GiB for what a CPU process adds once it steps besides its "
                "tensors (the kernels' code, the math libraries' buffers, glibc's small allocations)")
    if torch.cuda.is_available():
        return fixed_bytes(torch.device("cuda", torch.cuda.current_device())), "measured: the CUDA device memory in use"
    return ASSUMED_CUDA_FIXED_BYTES, "assumed for a CUDA context (no GPU here to measure it)"


def planning_inputs(cfg: TrainingWorkload, world_size: int, device: torch.device) -> PlanningInputs:
    """The planner's inputs for ``cfg`` on ``world_size`` processes, with the fixed cost of this process as it
    starts (``process_fixed_bytes``).

    Raises:
        UserError: ``max_seq_len`` is not set (the activations are sized by it), or ``world_size`` is not a multiple
            of ``fsdp.replicate_degree``.
    """
    if cfg.max_seq_len is None:
        raise UserError("max_seq_len: must be set to estimate memory (ac_mode: auto, tune plan): it sizes the activations")
    cfg.fsdp.shard_degree(world_size)  # a world of whole HSDP rows, or a one-line error naming the key
    workload = Workload(
        batch_size=cfg.batch_size,
        seq_len=cfg.max_seq_len,
        gradient_accumulation_steps=cfg.gradient_accumulation_steps,
        dtype=cfg.dtype,
        world_size=world_size,
        fsdp=cfg.fsdp,
        # Packed rows on a GPU in bf16 take varlen_attn (models/attention.py), whose K/V copies the simulation
        # cannot make on a CPU's kernels.
        varlen=(bool(cfg.dataset.kwargs.get("packed", False)) and planned_device(cfg.device).type == "cuda"
                and cfg.dtype is DType.BF16),
    )
    return PlanningInputs(
        build_model=lambda: cfg.model.instantiate_with_defaults(checkpoint_dir=cfg.checkpoint_dir),
        make_optimizer=cfg.optimizer.instantiate,
        workload=workload,
        device=device,
        fixed_bytes=process_fixed_bytes(cfg.device)[0],
    )


@dataclass(frozen=True)
class PlanTable:
    """``tune plan``'s answer: one estimate per AC setting, the budget, the row ``ac_mode: auto`` picks, and the
    switches' ablation: the full-AC estimate with each memory switch added to the ones before."""

    title: str
    estimates: list[MemoryEstimate]
    budget_gib: Optional[float]
    chosen: Optional[int]  # index into estimates; None when nothing fits or there is no budget
    notes: tuple[str, ...] = ()  # what this estimate leaves out of the config, printed before the assumptions
    ablation: tuple[tuple[str, MemoryEstimate], ...] = ()
    fixed_how: str = ""  # how the process's fixed cost was obtained (measured, or assumed)
    # index into estimates -> why the config's switches refuse that AC setting (the row is shown, marked so)
    not_applicable: dict[int, str] = dataclasses.field(default_factory=dict)

    def _fits(self, estimate: MemoryEstimate) -> str:
        if self.budget_gib is None:
            return ""
        return "  yes" if estimate.device <= self.budget_gib * GiB else "  no"

    @property
    def unit(self) -> tuple[str, int]:
        """The unit the estimates are shown in, and its bytes: GiB, or MiB when every device total is below 1 GiB."""
        return ("GiB", GiB) if max(e.device for e in self.applicable()) >= GiB else ("MiB", 2**20)

    def applicable(self) -> list[MemoryEstimate]:
        """The estimates of the AC settings the config's switches allow (what ``draw_plan`` draws)."""
        return [e for i, e in enumerate(self.estimates) if i not in self.not_applicable]

    def bar_labels(self) -> list[str]:
        """What ``draw_plan`` writes above each bar: its device total in the table's unit, and its extra recompute."""
        unit, scale = self.unit
        digits = 2 if unit == "GiB" else 0
        return [f"{e.device / scale:.{digits}f} {unit}\n{e.extra_flops:+.0%}" for e in self.applicable()]

    def lines(self) -> list[str]:
        unit, scale = self.unit
        fits = "  fits" if self.budget_gib is not None else ""
        header = (f"{'setting':<17} {'activations':>11} {'parameters':>10} {'gradients':>9} {'optimizer':>9} "
                  f"{'transient':>9} {'step':>7} {'process':>7} {'device':>7} {'host':>7} {'recompute':>9} "
                  f"{'saved/fwd':>9}{fits}")
        out = [self.title,
               f"estimated {unit} per process at the peak of one step: the five parts add up to the step; device is "
               "the step and the process's own (fixed) cost; host is what the switches keep in host memory", header]
        for i, e in enumerate(self.estimates):
            if i in self.not_applicable:
                reason = self.not_applicable[i].split("; ")[0]  # the why, without the error's fix for a run
                out.append(f"{describe_setting(e.plan):<17} not applicable: {reason}")
                continue
            row = (f"{describe_setting(e.plan):<17} {e.activations / scale:>11.2f} {e.parameters / scale:>10.2f} "
                   f"{e.gradients / scale:>9.2f} {e.optimizer / scale:>9.2f} {e.transient / scale:>9.2f} "
                   f"{e.total / scale:>7.2f} {e.fixed / scale:>7.2f} {e.device / scale:>7.2f} {e.host / scale:>7.2f} "
                   f"{e.extra_flops:>+9.1%} {e.saved_activations / scale:>9.2f}{self._fits(e)}")
            if i == self.chosen:
                row += "   <- ac_mode: auto picks this (the least recompute that fits)"
            out.append(row)
        if self.budget_gib is not None and self.chosen is None:
            out.append(f"nothing fits {self.budget_gib:g} GiB: lower batch_size or max_seq_len, add processes, or turn on "
                       "another memory switch (below)")
        out.append("activations: saved for backward and alive at the peak; transient: backward temporaries, a block's "
                   "recompute, the loss's gradients, FSDP2's gathered parameters and reduce buffers; recompute: extra "
                   "matrix-multiply and attention FLOPs of the step; saved/fwd: what one forward keeps for backward; "
                   f"process: {self.fixed_how}.")
        if len(self.ablation) > 1:
            width = max(len(label) for label, _ in self.ablation)
            out += ["", f"with full AC, each memory switch added to the ones above ({unit} per process):",
                    f"{'switches':<{width}} {'optimizer':>9} {'step':>7} {'device':>7} {'host':>7}{fits}"]
            for label, e in self.ablation:
                out.append(f"{label:<{width}} {e.optimizer / scale:>9.2f} {e.total / scale:>7.2f} "
                           f"{e.device / scale:>7.2f} {e.host / scale:>7.2f}{self._fits(e)}")
        out.extend(f"Note: {note}" for note in self.notes)
        out.append(f"Assumptions: {ASSUMPTIONS}.")
        return out


def plan_table(cfg: TrainingWorkload, *, world_size: int, budget_gib: Optional[float]) -> PlanTable:
    """Estimate every AC setting for ``cfg`` on ``world_size`` processes, with its memory switches as configured,
    and the full-AC estimate with each switch added in turn (``switch_ablation``).

    Raises:
        UserError: the config's memory switches are refused, or ``max_seq_len`` is unset.
    """
    try:
        model = build_meta_model(cfg.model, cfg.checkpoint_dir)
    except UnavailableError as err:
        # from_hf_config and a checkpoint of another machine: there is no architecture to simulate a step of.
        raise UnavailableError(f"{err}, and model {cfg.model.path} reads the architecture from it: to plan here, copy "
                               "its config.json alone (no weights) into a folder and set checkpoint_dir to it, or name "
                               "the model's builder (model._component_=torchtune_ac.models.llama3_8b, ...)") from None
    # The switches besides AC, resolved as a run resolves them with each AC setting (every one gets a row of its
    # own); a setting the switches refuse (enable_activation_offloading with no AC) is a row that does not apply.
    candidates = candidate_plans(len(transformer_blocks(model)))
    plans: list[Optional[MemoryPlan]] = []
    not_applicable: dict[int, str] = {}
    for index, candidate in enumerate(candidates):
        try:
            plans.append(resolve_config_plan(cfg, model, ACConfig(ac_mode=candidate.mode, ac_option=candidate.option)))
        except UserError as err:
            plans.append(None)
            not_applicable[index] = str(err)
    plan = next((p for p in reversed(plans) if p is not None), None)
    if plan is None:  # no AC setting works with these switches: the config cannot run, say why once
        raise UserError(not_applicable[len(candidates) - 1])
    fixed, fixed_how = process_fixed_bytes(cfg.device)
    inputs = planning_inputs(cfg, world_size, torch.device("cpu"))
    workload = inputs.workload.with_settings(plan.settings, clip_grad_norm=cfg.clip_grad_norm)
    estimates = [dataclasses.replace(e, fixed=fixed)
                 for e in estimate_memory(inputs.build_model, inputs.make_optimizer, workload, candidates)]
    ablation = switch_ablation(inputs.build_model, inputs.make_optimizer, workload, estimates[-1].plan,
                               planned_device(cfg.device), fixed)
    chosen = None
    if budget_gib is not None:
        chosen = next((i for i, e in enumerate(estimates)
                       if i not in not_applicable and e.device <= budget_gib * GiB), None)
    n_params = sum(p.numel() for p in model.parameters())
    switches = "; ".join(f"{label}: {re.split(r'[:(]', value)[0].strip()}" for label, value in plan.describe(ac=False))
    title = (f"{cfg.model.path}: {n_params:,} parameters; {describe_processes(cfg.fsdp, world_size)}, batch {cfg.batch_size} x "
             f"{cfg.max_seq_len} tokens per process x {cfg.gradient_accumulation_steps} accumulation step(s), "
             f"{cfg.dtype.value}, {cfg.optimizer.path.rsplit('.', 1)[-1]}; {switches}")
    return PlanTable(title, estimates, budget_gib, chosen, unmodelled_settings(cfg, world_size), tuple(ablation),
                     fixed_how, not_applicable)


def describe_processes(fsdp: FSDPConfig, world_size: int) -> str:
    """``4 process(es)``, or with HSDP ``4 process(es) (2 replicas x 2 shards)``: what FSDP2 shards over."""
    if fsdp.replicate_degree == 1:
        return f"{world_size} process(es)"
    return (f"{world_size} process(es) ({fsdp.replicate_degree} replicas x {fsdp.shard_degree(world_size)} shards, "
            "HSDP)")


def unmodelled_settings(cfg: TrainingWorkload, world_size: int) -> tuple[str, ...]:
    """What the estimate leaves out of ``cfg`` on ``world_size`` processes, one sentence each."""
    mixed = cfg.fsdp.param_dtype
    if world_size == 1 or mixed is None or mixed is cfg.dtype:
        return ()
    direction = "higher" if mixed.torch.itemsize < cfg.dtype.torch.itemsize else "lower"
    return (f"fsdp.param_dtype={mixed.value} is not modelled: activations and gathered weights are counted in "
            f"{cfg.dtype.value} (dtype), so the estimate is {direction} than the run's",)


def draw_plan(table: PlanTable, path: Path) -> Path:
    """A stacked bar per setting (parameters, optimizer state, gradients, activations, transient, the process's
    fixed cost), with the budget as a line, written as a PNG.

    Raises:
        UserError: matplotlib is missing (``pip install 'torchtune_ac[plot]'``), or the file cannot be written.
    """
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise UserError("--png needs matplotlib: pip install 'torchtune_ac[plot]'") from None
    names = [describe_setting(e.plan).replace(" block", "\nblock") for e in table.applicable()]
    parts = [("parameters", "parameters", "tab:gray"), ("optimizer state", "optimizer", "tab:brown"),
             ("gradients", "gradients", "tab:orange"), ("activations", "activations", "tab:blue"),
             ("transient", "transient", "tab:green"), ("process (fixed)", "fixed", "tab:purple")]
    # Small models in MiB, as the table shows them: in GiB to one decimal they all read "0.4".
    unit, scale = table.unit
    fig, ax = plt.subplots(figsize=(max(6.0, 1.3 * len(names)), 4.8))
    bottom = [0.0] * len(names)
    for label, attr, color in parts:
        heights = [getattr(e, attr) / scale for e in table.applicable()]
        ax.bar(names, heights, bottom=bottom, label=label, color=color)
        bottom = [b + h for b, h in zip(bottom, heights)]
    for i, text in enumerate(table.bar_labels()):
        ax.annotate(text, (i, bottom[i]), ha="center", va="bottom", fontsize=8)
    budget = None if table.budget_gib is None else table.budget_gib * GiB / scale
    if budget is not None:
        ax.axhline(budget, color="tab:red", linestyle="--", label=f"budget {table.budget_gib:g} GiB")
    ax.set_ylabel(f"{unit} per process at the step's peak")
    ax.set_title(table.title, fontsize=7, wrap=True)
    ax.legend(fontsize=8)
    ax.set_ylim(0, max(bottom + [budget or 0]) * 1.2)
    fig.tight_layout()
    try:
        fig.savefig(path, dpi=110, format="png")
    except OSError as err:
        raise UserError(f"--png {path}: cannot write it ({err.strerror})") from None
    finally:
        plt.close(fig)
    return path
