"""``tune plan``'s table: the memory per process of every activation-checkpointing setting for a config, the row
``ac_mode: auto`` picks, and the memory features added one by one (torchtune's ablation, from the planner), then
the run's plan as ``tune validate`` prints it.

The estimates come from ``torchtune_ac.memory.planner`` (a simulated step under fake tensors), with the planner's
inputs for the config (``run/plan.py``). A recipe declares that ``tune plan`` can answer for it by defining
``plan`` (see ``torchtune_ac/registry.py``'s ``PlannedRecipe``).
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch

from torchtune_ac.config.meta_model import build_meta_model
from torchtune_ac.errors import UnavailableError, UserError
from torchtune_ac.memory.plan import MemoryPlan
from torchtune_ac.memory.planner import (
    GiB,
    MemoryEstimate,
    Workload,
    candidate_plans,
    describe_setting,
    estimate_memory,
    suggested_tensor_parallel_degree,
    switch_ablation,
)
from torchtune_ac.models.families import transformer_blocks
from torchtune_ac.models.moe import (GROUPED, GROUPED_MM_CUDA_MAJORS, PADDED_BMM, GroupedExperts,
                                     choose_expert_kernel, moe_args_of)
from torchtune_ac.run.plan import (
    RunPlan,
    RunConfig,
    planned_device,
    planner_inputs,
    process_fixed_bytes,
    resolve_features,
    resolve_parallelism,
    resolve_run_plan,
    unmodelled_settings,
)
from torchtune_ac.runtime.process_memory import cublas_workspace_bytes
from torchtune_ac.activation_checkpointing.config import ACConfig

ASSUMPTIONS = (
    "every row is max_seq_len tokens and every position a target (the loss's worst case); parameters compute in "
    "their storage dtype; the caching allocator's fragmentation is not included: on CUDA, device compares with "
    "max_memory_reserved plus the context; on a CPU, with the peak resident set of a run with ac_mode: auto, which "
    "has glibc map each tensor on its own so that its resident memory follows its tensors (other CPU runs leave "
    "glibc as it is, for speed, and peak higher: the pages of freed tensors stay resident)"
)


@dataclass(frozen=True)
class MemoryTable:
    """``tune plan``'s answer: one estimate per AC setting, the budget, the row ``ac_mode: auto`` picks, and the
    switches' ablation: the full-AC estimate with each memory switch added to the ones before."""

    title: str
    estimates: list[MemoryEstimate]
    budget_gib: Optional[float]
    chosen: Optional[int]  # index into estimates; None when nothing fits or there is no budget
    notes: tuple[str, ...] = ()  # what this estimate leaves out of the config, printed before the assumptions
    ablation: tuple[tuple[str, MemoryEstimate], ...] = ()
    fixed_how: str = ""  # how the process's fixed cost was obtained (measured, or assumed)
    blas_how: str = ""  # on CUDA: how the cuBLAS workspaces in transient were obtained ("": none, on a CPU)
    # index into estimates -> why the config's features refuse that AC setting (the row is shown, marked so)
    not_applicable: dict[int, str] = dataclasses.field(default_factory=dict)
    # The run's plan, as tune validate prints it (None: ac_mode: auto with nothing chosen, no budget or no fit).
    run_plan: Optional[RunPlan] = None
    # A tensor-parallel degree to try when nothing fits (None: the run has one already, or the model none).
    suggested_tp: Optional[int] = None
    compiled: bool = False  # compile: true (the legend says how compiled blocks are simulated)
    # A mixture of experts: what the estimate assumes of its routed rows (added to the assumptions; "": dense).
    routed_rows: str = ""

    def _fits(self, estimate: MemoryEstimate) -> str:
        if self.budget_gib is None:
            return ""
        return "  yes" if estimate.device <= self.budget_gib * GiB else "  no"

    @property
    def unit(self) -> tuple[str, int]:
        """The unit the estimates are shown in, and its bytes: GiB, or MiB when every device total is below 1 GiB."""
        return ("GiB", GiB) if max(e.device for e in self.applicable()) >= GiB else ("MiB", 2**20)

    def applicable(self) -> list[MemoryEstimate]:
        """The estimates of the AC settings the config's features allow (what ``draw_memory_table`` draws)."""
        return [e for i, e in enumerate(self.estimates) if i not in self.not_applicable]

    def bar_labels(self) -> list[str]:
        """What ``draw_memory_table`` writes above each bar: its device total in the table's unit, and its extra recompute."""
        unit, scale = self.unit
        digits = 2 if unit == "GiB" else 0
        return [f"{e.device / scale:.{digits}f} {unit}\n{e.extra_flops:+.0%}" for e in self.applicable()]

    def lines(self) -> list[str]:
        """The table, then the run's plan as ``tune validate`` prints it."""
        out = self.table_lines()
        if self.run_plan is not None:
            summary = self.run_plan.describe()
            width = max(len(label) for label, _ in summary)
            out += ["", "the run's plan, as tune validate prints it:"]
            out += [f"  {label:<{width}}  {value}" for label, value in summary]
        return out

    def table_lines(self) -> list[str]:
        unit, scale = self.unit
        fits = "  fits" if self.budget_gib is not None else ""
        # A DPO step's resident reference model: a column of its own, only when there is one.
        reference = any(e.reference for e in self.estimates)
        rollouts = any(e.rollouts for e in self.estimates)  # a GRPO step's generation: a column when there is one
        header = (f"{'setting':<17} {'activations':>11} {'parameters':>10} " + (f"{'reference':>9} " if reference else "")
                  + (f"{'rollouts':>9} " if rollouts else "")
                  + f"{'gradients':>9} {'optimizer':>9} "
                  f"{'transient':>9} {'step':>7} {'process':>7} {'device':>7} {'host':>7} {'recompute':>9} "
                  f"{'saved/fwd':>9}{fits}")
        out = [self.title, f"estimated {unit} per process at the peak of one step: the parts add up to the step; device is "
               "the step and the process's own (fixed) cost; host is what the switches keep in host memory", header]
        for i, e in enumerate(self.estimates):
            if i in self.not_applicable:
                reason = self.not_applicable[i].split("; ")[0]  # the why, without the error's fix for a run
                out.append(f"{describe_setting(e.plan):<17} not applicable: {reason}")
                continue
            reference_cell = f"{e.reference / scale:>9.2f} " if reference else ""
            reference_cell += f"{e.rollouts / scale:>9.2f} " if rollouts else ""
            row = (f"{describe_setting(e.plan):<17} {e.activations / scale:>11.2f} {e.parameters / scale:>10.2f} "
                   f"{reference_cell}{e.gradients / scale:>9.2f} {e.optimizer / scale:>9.2f} {e.transient / scale:>9.2f} "
                   f"{e.total / scale:>7.2f} {e.fixed / scale:>7.2f} {e.device / scale:>7.2f} {e.host / scale:>7.2f} "
                   f"{e.extra_flops:>+9.1%} {e.saved_activations / scale:>9.2f}{self._fits(e)}")
            if i == self.chosen:
                row += "   <- ac_mode: auto picks this (the least recompute that fits)"
            out.append(row)
        if self.budget_gib is not None and self.chosen is None:
            out.append(f"nothing fits {self.budget_gib:g} GiB: lower batch_size or max_seq_len, add processes, or turn on "
                       "another memory switch (below)")
            if self.suggested_tp is not None:
                out.append(f"or split each layer over the GPUs of a node: tensor_parallel_dim={self.suggested_tp} "
                           "divides parameters, gradients and optimizer state by it once more and the activations of "
                           f"the split layers by it (tune plan ... tensor_parallel_dim={self.suggested_tp})")
        if reference and not rollouts:
            out.append("reference: the DPO reference model's parameters, resident and sharded as the policy's "
                       "(dpo.reference: precomputed frees it)")
        if rollouts:
            out.append("rollouts: the generation before each step (the KV cache of every completion at the longest "
                       "prompt plus generation.max_new_tokens, the decode's logits, the prompts' forward); the step "
                       "holds the larger of it and gradients + activations + transient"
                       + ("; reference: the GRPO reference model (grpo.beta > 0), resident and sharded as the policy's"
                          if reference else ""))
        out.append("activations: saved for backward and alive at the peak"
                   + (" (a compiled block without AC saves what inductor's partitioner keeps, fewer than eager)"
                      if self.compiled else "") + "; transient: backward temporaries, a block's "
                   "recompute, the loss's gradients, FSDP2's gathered parameters and reduce buffers"
                   + (f", cuBLAS's workspaces ({self.blas_how})" if self.blas_how else "") + "; recompute: extra "
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
        out.append(f"Assumptions: {ASSUMPTIONS}{'; ' + self.routed_rows if self.routed_rows else ''}.")
        return out


def memory_table(cfg: RunConfig, *, world_size: int, budget_gib: Optional[float]) -> MemoryTable:
    """Estimate every AC setting for ``cfg`` on ``world_size`` processes, with its memory features as configured,
    and the full-AC estimate with each feature added in turn (``switch_ablation``); and the run's plan, with
    ``ac_mode: auto``'s choice from the table (the planner's first row that fits, as a run chooses it).

    Raises:
        UserError: the config's memory features are refused, or ``max_seq_len`` is unset.
    """
    try:
        model = build_meta_model(cfg.model, cfg.checkpoint_dir)  # the one meta build
    except UnavailableError as err:
        # from_hf_config and a checkpoint of another machine: there is no architecture to simulate a step of.
        raise UnavailableError(f"{err}, and model {cfg.model.path} reads the architecture from it: to plan here, copy "
                               "its config.json alone (no weights) into a folder and set checkpoint_dir to it, or name "
                               "the model's builder (model._component_=torchtune_ac.models.llama3_8b, ...)") from None
    # The run's own checks of the degrees against the world size and the model (resolve_run_plan below makes them
    # too, but its refusal there only leaves the table without a plan, and every row would plan what cannot run).
    parallelism = resolve_parallelism(cfg, model, world_size)
    # The features besides AC, resolved as a run resolves them with each AC setting (every one gets a row of its
    # own); a setting the features refuse (enable_activation_offloading with no AC) is a row that does not apply.
    candidates = candidate_plans(len(transformer_blocks(model)))
    resolved: list[Optional[MemoryPlan]] = []
    not_applicable: dict[int, str] = {}
    for index, candidate in enumerate(candidates):
        try:
            resolved.append(resolve_features(cfg, model, ACConfig(ac_mode=candidate.mode, ac_option=candidate.option)))
        except UserError as err:
            resolved.append(None)
            not_applicable[index] = str(err)
    features = next((p for p in reversed(resolved) if p is not None), None)
    if features is None:  # no AC setting works with these features: the config cannot run, say why once
        raise UserError(not_applicable[len(candidates) - 1])
    fixed, fixed_how = process_fixed_bytes(cfg.device)
    inputs = planner_inputs(cfg, parallelism, torch.device("cpu"), model)
    workload = inputs.workload.with_settings(features.settings, clip_grad_norm=cfg.clip_grad_norm)
    estimates = [dataclasses.replace(e, fixed=fixed)
                 for e in estimate_memory(inputs.build_model, inputs.make_optimizer, workload, candidates)]
    ablation = switch_ablation(inputs.build_model, inputs.make_optimizer, workload, estimates[-1].plan,
                               planned_device(cfg.device), fixed, configured=estimates[-1])  # the full-AC row
    chosen = None
    if budget_gib is not None:
        chosen = next((i for i, e in enumerate(estimates)
                       if i not in not_applicable and e.device <= budget_gib * GiB), None)
    run_plan = None  # ac_mode: auto with nothing chosen, or a config its own features refuse (see the rows)
    if not cfg.ac.is_auto or chosen is not None:
        try:
            run_plan = resolve_run_plan(cfg, model, world_size=world_size,
                                        auto_choice=(estimates[chosen], budget_gib) if cfg.ac.is_auto else None)
        except UserError:
            pass
    switches = "; ".join(f"{label}: {re.split(r'[:(]', value)[0].strip()}"
                         for label, value in features.describe(ac=False))
    n_params = sum(p.numel() for p in model.parameters())
    suggested_tp = None
    if chosen is None and budget_gib is not None and not parallelism.tensor_parallel:
        suggested_tp = suggested_tensor_parallel_degree(model, world_size)
    title = (f"{cfg.model.path}: {n_params:,} parameters; "
             f"{parallelism.describe_processes()}, batch "
             f"{cfg.batch_size} x {cfg.max_seq_len} tokens per process x {cfg.gradient_accumulation_steps} "
             f"accumulation step(s), {cfg.dtype.value}{', compiled blocks' if cfg.compile else ''}, "
             f"{cfg.optimizer.path.rsplit('.', 1)[-1]}; {switches}")
    blas, blas_how = cublas_workspace_bytes(planned_device(cfg.device))
    notes = unmodelled_settings(cfg, world_size) + ((workload.images.describe(),) if workload.images else ())
    return MemoryTable(title, estimates, budget_gib, chosen, notes, tuple(ablation),
                       fixed_how, blas_how if blas else "", not_applicable, run_plan, suggested_tp, cfg.compile,
                       routed_rows_assumption(model, workload, planned_device(cfg.device)))


def routed_rows_assumption(model: torch.nn.Module, workload: Workload, device: torch.device) -> str:
    """What the estimate assumes of a mixture of experts' routed rows, and which experts' kernel it charges against
    the one the run's ``device`` takes, in words ("" for a dense model)."""
    args = moe_args_of(model)
    if args is None:
        return ""
    if not workload.parallelism.expert_parallel:
        rows = (f"each process's experts compute its own tokens' {args.top_k} copies (top_k), whatever the router "
                "does (no expert parallelism)")
    else:
        rows = (f"under expert parallelism each process's experts receive {workload.routed_rows_margin:g}x the rows "
                f"a balanced router sends them (its own tokens' {args.top_k} copies: routing is dropless, and a "
                "router out of balance sends a process more), and the all-to-all buffers are sized alike")
    return f"{rows}; {expert_kernel_charged(model, workload.dtype.torch, device)}"


_KERNEL_NAMES = {GROUPED: "torch's grouped matmul", PADDED_BMM: "the padded batched matmul"}


def expert_kernel_charged(model: torch.nn.Module, dtype: torch.dtype, device: torch.device) -> str:
    """Which experts' kernel the simulation charges (the one a CPU takes: ``choose_expert_kernel``), and which the
    run's device takes (``models/moe.py``'s gate: grouped on CUDA sm90/sm100 in bf16), in words. Where they differ,
    the padded path's buffers (rows padded to the busiest expert) are said not to be counted."""
    experts = next(m for m in model.modules() if isinstance(m, GroupedExperts))
    charged = choose_expert_kernel("cpu", dtype, None, experts.inner_dims)
    said = f"the experts' kernel charged is {_KERNEL_NAMES[charged]}"
    if device.type != "cuda":
        return f"{said}, the one a CPU run takes"
    where = "this machine's GPU"
    if torch.cuda.is_available():
        capability = torch.cuda.get_device_capability()
        where += f" (compute capability {capability[0]}.{capability[1]})"
        takes = choose_expert_kernel("cuda", dtype, capability, experts.inner_dims)
    elif dtype != torch.bfloat16:
        where, takes = f"a GPU in {str(dtype).removeprefix('torch.')}", PADDED_BMM
    else:  # no GPU here to ask: the capability decides
        majors = " or ".join(f"{m}.x" for m in GROUPED_MM_CUDA_MAJORS)
        return (f"{said}, which a GPU of compute capability {majors} (H100, H200, B200) takes in bf16; any other "
                "GPU takes the padded batched matmul, whose buffers (rows padded to the busiest expert) are not "
                "counted")
    if takes == charged:
        return f"{said}, the one {where} takes"
    return (f"{said}, but {where} takes {_KERNEL_NAMES[takes]} (grouped needs bf16 on compute capability 9.x or "
            "10.x): its buffers, rows padded to the busiest expert, are not counted")


def draw_memory_table(table: MemoryTable, path: Path) -> Path:
    """A stacked bar per setting (parameters, optimizer state, gradients, activations, transient, the process's
    fixed cost), with the budget as a line, written as a PNG. A GRPO step's rollouts: in place of the step's own
    parts in a bar where the generation is the peak, else a dotted mark at the height they reach.

    Raises:
        UserError: matplotlib is missing (``pip install 'torchtune_ac[plot]'``), or the file cannot be written.
    """
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise UserError("--png needs matplotlib: pip install 'torchtune_ac[plot]'") from None
    estimates = table.applicable()
    names = [describe_setting(e.plan).replace(" block", "\nblock") for e in estimates]
    parts = [("parameters", "parameters", "tab:gray"), ("reference model", "reference", "tab:olive"),
             ("optimizer state", "optimizer", "tab:brown"), ("rollouts (generation)", "rollouts", "tab:cyan"),
             ("gradients", "gradients", "tab:orange"), ("activations", "activations", "tab:blue"),
             ("transient", "transient", "tab:green"), ("process (fixed)", "fixed", "tab:purple")]
    # At the peak a step holds the larger of its rollouts and its own parts (``MemoryEstimate.total``).
    generating = [e.rollouts > e.step_peak for e in estimates]

    def height(e, attr: str, at_generation: bool) -> float:
        if attr == "rollouts":
            return e.rollouts if at_generation else 0
        if attr in ("gradients", "activations", "transient") and at_generation:
            return 0
        return getattr(e, attr)

    # Small models in MiB, as the table shows them: in GiB to one decimal they all read "0.4".
    unit, scale = table.unit
    fig, ax = plt.subplots(figsize=(max(6.0, 1.3 * len(names)), 4.8))
    bottom = [0.0] * len(names)
    for label, attr, color in parts:
        heights = [height(e, attr, g) / scale for e, g in zip(estimates, generating)]
        if attr == "rollouts" and not any(heights):
            continue
        ax.bar(names, heights, bottom=bottom, label=label, color=color)
        bottom = [b + h for b, h in zip(bottom, heights)]
    below = [(i, (e.parameters + e.reference + e.optimizer + e.rollouts) / scale)
             for i, (e, g) in enumerate(zip(estimates, generating)) if e.rollouts and not g]
    for n, (i, level) in enumerate(below):
        ax.hlines(level, i - 0.4, i + 0.4, colors="tab:cyan", linestyles=":", linewidth=2,
                  label="rollouts (generation, below the step's peak)" if n == 0 else None)
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
