"""What the planner estimates and what it answers: one process's step (``Workload``), the estimate of one AC
plan (``MemoryEstimate``), and the plans worth a row (``candidate_plans``)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Mapping, Optional, Union


from torchtune_ac.memory.feature import Feature
from torchtune_ac.memory.features import STEP_FEATURES, MemorySettings
from torchtune_ac.parallel.fsdp import FSDPConfig
from torchtune_ac.memory.planner.rollouts import RolloutStep
from torchtune_ac.runtime.parallelism import Parallelism
from torchtune_ac.runtime.dtypes import DType
from torchtune_ac.activation_checkpointing.mechanism import (
    OP_OPTION,
    ACMode,
    ACPlan,
    ac_plan,
)

GiB = 2**30
# Strides of selective AC worth a row, besides none, per-op and full (one row per distinct block count).
STRIDES = (2, 4)
# The rows a process's experts receive under expert parallelism, as a multiple of a balanced router's share (its own
# tokens' k copies, T * k). Routing is dropless: a busy process computes every row sent to it. The Switch
# Transformer trains with capacity factors of 1.0 to 1.25 and drops what overflows them; a dropless process holds
# what it would drop, so the plan takes half again the balanced share, above that range. A process's share sums
# E / ep experts' loads, so it strays less from balance than one expert's does; a router further from balance than
# 1.5x on a process is what the load-balancing loss (router_aux_loss_coef) is for. Without expert parallelism a
# process computes exactly its own tokens' copies, whatever the router does: no margin.
ROUTED_ROWS_MARGIN = 1.5
PHASES = ("forward", "loss backward", "blocks backward", "rest of backward", "optimizer step")
BACKWARD_PHASES = ("loss backward", "blocks backward", "rest of backward")


@dataclass(frozen=True)
class PreferenceStep:
    """A preference step (DPO, ``training/dpo.py``): each sample is a pair whose chosen and rejected rows go through
    the model in one forward (two rows a sample), scored by the DPO objective.

    Attributes:
        resident_reference: a frozen model of the same shape (sharded like it, no gradients, no optimizer state)
            stays resident and runs under ``no_grad`` before each forward; False: its log-probabilities come with the
            batch (``dpo.reference: precomputed``), and no reference model is kept.
        reference_is_policy: the reference is the policy itself with its adapters off (``lora_dpo``): no second
            model, but a forward of the policy under ``no_grad`` before each micro-batch's (the rank-r adapters'
            part of it, off in the run, is run too: a few transient ``[b, s, r]`` tensors).
    """

    resident_reference: bool
    reference_is_policy: bool = False


@dataclass(frozen=True)
class ImageLoad:
    """The images of every sample of a vision-language step: ``per_sample`` images of ``height x width`` pixels
    each, the size the processor hands the model (an image's ``tokens``, and its patches in the vision tower, follow
    from it), their tokens at the start of each row. ``how``: where the size came from, in words (the plan says it)."""

    per_sample: int
    height: int
    width: int
    tokens: int
    how: str = ""

    def describe(self) -> str:
        """What the plan assumed, in words."""
        return (f"images: {self.per_sample} per sample of {self.height} x {self.width} pixels ({self.tokens} image "
                f"tokens each, within max_seq_len), the size being {self.how}; planned_images.* set others")


@dataclass(frozen=True)
class Workload:
    """What one process does in a step.

    Attributes:
        batch_size: samples per micro-batch on each process.
        seq_len: tokens per sample (the config's ``max_seq_len``).
        gradient_accumulation_steps: micro-batches per step (gradients live across them).
        dtype: storage dtype of parameters and optimizer state.
        parallelism: how the processes split the work (FSDP2 shards parameters, gradients and optimizer state over
            its ``shard`` degree; tensor parallelism splits each layer over its ``tensor`` degree).
        fsdp: FSDP2 settings (used when the model is sharded).
        clip_grad_norm: the config's value.
        settings: the memory features' settings besides AC (``MemorySettings``; see
            ``memory/features.py``); a feature not named here has its ``off`` setting.
    """

    batch_size: int
    seq_len: int
    gradient_accumulation_steps: int = 1
    dtype: DType = DType.FP32
    parallelism: Parallelism = Parallelism()
    fsdp: FSDPConfig = field(default_factory=FSDPConfig)
    clip_grad_norm: Optional[float] = None
    settings: MemorySettings = MemorySettings()
    # Packed rows whose attention takes ``varlen_attn`` (CUDA, bf16): the K/V copies it makes on this torch are
    # counted (``models.attention.varlen_kv_copy_bytes``), which the simulation, on a CPU's kernels, cannot make.
    varlen: bool = False
    # A preference step (DPO) instead of the token loss: pairs of rows, and the reference model when resident.
    preference: Optional[PreferenceStep] = None
    # Bytes of the cuBLAS workspaces the step's threads hold on a GPU (``runtime.process_memory``), which the
    # simulation on fake tensors cannot see: counted with the step's other allocations (``transient``).
    blas_workspaces: int = 0
    # Each block compiled (``compile: true``): the simulation runs the blocks without AC as compiled blocks save for
    # backward (``_simulate_compiled_blocks``), fewer tensors than eager.
    compiled: bool = False
    # The run's device is a GPU: its caching allocator keeps a pool per stream, and under FSDP2 the step in
    # backward runs on the reduce-scatter's stream (``in_backward_stream_pool``).
    cuda: bool = False
    # Under expert parallelism: the rows this process's experts receive, as a multiple of a balanced router's.
    routed_rows_margin: float = ROUTED_ROWS_MARGIN
    # A GRPO step: the rollouts generated before it (``rollouts.py``); the step itself is the loss pass over them.
    rollouts: Optional[RolloutStep] = None
    # A vision-language step: the images in every row (None: text only; the tower still runs on a blank image).
    images: Optional[ImageLoad] = None

    @property
    def rows(self) -> int:
        """Rows per micro-batch through the model: the samples, or twice as many for preference pairs."""
        return self.batch_size * (2 if self.preference is not None else 1)

    @property
    def world_size(self) -> int:
        return self.parallelism.world_size

    @property
    def shard_degree(self) -> int:
        """Processes FSDP2 shards each parameter over."""
        return self.parallelism.shard

    def with_settings(self, settings: Union[MemorySettings, Mapping[str, Any]], **changes: Any) -> "Workload":
        """This workload with the features' ``settings`` (a plan's, whole; or some features' by name, over its
        own) and other fields changed."""
        settings = settings if isinstance(settings, MemorySettings) else self.settings.changed(settings)
        return dataclasses.replace(self, settings=settings, **changes)

    def feature_settings(self) -> list[tuple[Feature, Any]]:
        """The memory features besides AC, in order, with their settings (AC is the plan's, not the workload's)."""
        return [(feature, self.settings.of(feature)) for feature in STEP_FEATURES]


@dataclass(frozen=True)
class MemoryEstimate:
    """The estimated memory of one process for one AC plan, in bytes.

    ``total`` is the peak of the step. At that moment it is made of: ``parameters`` and ``optimizer`` (resident,
    sharded; a DPO step's resident ``reference`` model too), the ``gradients`` alive, the saved ``activations`` still alive, and ``transient`` (the rest:
    backward temporaries, a block's recompute, the loss's gradients, FSDP's gathered parameters and reduce
    buffers, the batch). ``saved_activations`` is what one micro-batch's forward keeps for backward (what
    ``scripts/bench/_measure.py`` measures); ``extra_flops`` is the share of
    floating-point work the plan adds by recomputing (0.21 = +21 %); ``peak_phase`` is where the peak falls.
    """

    plan: ACPlan
    parameters: int
    optimizer: int
    gradients: int
    activations: int
    transient: int
    saved_activations: int
    extra_flops: float
    peak_phase: str
    flops: float  # floating-point operations of the step (matrix multiplies and attention)
    host: int = 0  # bytes the features keep in the host's memory instead (not in ``total``)
    host_parts: Mapping[str, int] = field(default_factory=dict)  # ``host`` by category
    fixed: int = 0  # the process's own cost on the device, before any tensor of the step (see ``device``)
    reference: int = 0  # a resident reference model's parameters (DPO, ``PreferenceStep``), sharded as the policy's
    rollouts: int = 0  # a GRPO step's generation (``rollouts.py``), alive before the step's gradients and activations

    @property
    def total(self) -> int:
        """The step's tensors at its peak: the parameters, the optimizer state, a resident reference model, and the
        larger of the step's own tensors (gradients, activations, transient) and a GRPO step's rollouts."""
        return self.parameters + self.optimizer + self.reference + max(self.step_peak, self.rollouts)

    @property
    def device(self) -> int:
        """What the process needs on its device: the step's tensors and the process's fixed cost (on a CPU, the
        resident set of its imports; on CUDA, the context and the allocator's reserve), measured when it starts."""
        return self.total + self.fixed

    @property
    def step_peak(self) -> int:
        """What the step adds above the resident parameters and optimizer state (a measured VmHWM increase)."""
        return self.gradients + self.activations + self.transient


def describe_setting(plan: ACPlan) -> str:
    """A short name of an AC plan for tables: none, per-op, every 2nd block, full."""
    if plan.mode is ACMode.NONE:
        return "none"
    if plan.mode is ACMode.FULL:
        return "full"
    if plan.option == OP_OPTION:
        return "per-op"
    suffix = "th" if 10 <= plan.option % 100 <= 20 else {1: "st", 2: "nd", 3: "rd"}.get(plan.option % 10, "th")
    return f"every {plan.option}{suffix} block"


def candidate_plans(n_layers: int) -> list[ACPlan]:
    """The AC plans a planner compares, from the least recompute to the most: none, per-op, every k-th block for
    the strides in ``STRIDES`` (largest first, one row per distinct number of blocks), full."""
    settings: list[tuple[str, Any]] = [("none", None), ("selective", OP_OPTION)]
    counts = set()
    for k in sorted(STRIDES, reverse=True):
        if k <= n_layers and n_layers // k not in counts and n_layers // k < n_layers:
            counts.add(n_layers // k)
            settings.append(("selective", k))
    settings.append(("full", None))
    return [_plan(mode, option, n_layers) for mode, option in settings]


def _plan(mode: str, option: Any, n_layers: int) -> ACPlan:
    return ac_plan(ACMode(mode), option, n_layers)
