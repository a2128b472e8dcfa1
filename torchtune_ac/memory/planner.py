"""Will it fit? The memory per process of a training step, for every activation checkpointing setting.

Method: simulate, not guess. The real model and the recipe's own step (``accumulate_gradients`` then
``update_parameters``: forward, loss, backward with AC recompute, clipping, the optimizer step, or the step in
backward) run under ``FakeTensorMode``: tensors carry shapes and dtypes but no data and no memory, and kernels
are chosen as on a CPU (flash attention without a mask; CUDA's fused kernels keep the same output and log-sum-
exp). A dispatch mode records every tensor storage the step allocates and when it is freed, so the estimate
follows the step's real sequence of allocations: activations saved for backward, per-op AC caches, a block's
recompute, the logits or the chunked loss, gradients, the optimizer's temporaries. Parameters, optimizer
state and the batch exist before the step and are counted from their sizes.

Deep models are simulated shallower. The step is split into phases (forward, the loss's backward, the blocks'
backward, the rest of backward, the optimizer step) and each phase's peak is recorded; every block is alike,
so each phase's peak grows linearly with the number of blocks. The planner simulates two depths that repeat
the plan's pattern (2 and 4 blocks, or k and 2k for every k-th block) and extrapolates each phase to the
model's depth; the step's peak is the largest phase. A model no deeper than the second depth is simulated
whole. ``tests/unit/training/test_planner.py`` checks the extrapolation against whole-depth simulation.

Compiled blocks (``compile: true``): a block without AC runs as AOTAutograd's forward and backward graphs, traced
and partitioned as inductor partitions them, op by op (``_CompiledForward``): the step keeps what the compiled block
saves, fewer tensors than eager.

Several processes (FSDP2): the simulation runs one process's batch; parameters, optimizer state and gradients
are divided by the world size, and what FSDP2 adds is counted from the model's sizes: the root's parameters
stay gathered through forward and backward (``reshard_after_forward`` is false for the root), two blocks'
gathered parameters (the one running and the one prefetched; every block when
``fsdp.reshard_after_forward`` is false), and one block's unsharded gradients in the reduce dtype.

Assumptions (``tune plan`` prints them): every position of every row is a target (the loss's worst case),
rows are ``max_seq_len`` long, parameters compute in their storage dtype (FSDP mixed precision is not
modelled), and memory an allocator keeps beyond live tensors (fragmentation, caching) is not included.
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import logging
import math
import weakref
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Mapping, Optional, Sequence, Union

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten
from torch.utils.flop_counter import flop_registry

from torchtune_ac.errors import UnavailableError, UserError
from torchtune_ac.memory import cpu_offload, optimizer_state
from torchtune_ac.memory.chunked_loss import loss_objective
from torchtune_ac.memory.feature import Alternative, Feature, ModelSizes
from torchtune_ac.memory.features import STEP_FEATURES, MemorySettings
from torchtune_ac.memory.optimizer_in_backward import build_optimizer
from torchtune_ac.models.attention import varlen_kv_copy_bytes
from torchtune_ac.models.families import family_of, shard_groups, transformer_blocks
from torchtune_ac.models.llama import Attention
from torchtune_ac.models.tensor_parallel import tensor_parallel_problem
from torchtune_ac.parallel.fsdp import FSDPConfig
from torchtune_ac.runtime.parallelism import Parallelism
from torchtune_ac.runtime.dtypes import DType
from torchtune_ac.activation_checkpointing.mechanism import (
    OP_OPTION,
    ACMode,
    ACPlan,
    ac_plan,
    apply_ac_plan,
    is_checkpointed,
)
from torchtune_ac.training.step import accumulate_gradients

GiB = 2**30
# Strides of selective AC worth a row, besides none, per-op and full (one row per distinct block count).
STRIDES = (2, 4)
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
    """

    resident_reference: bool


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
    ``scripts/_measure.py`` measures); ``extra_flops`` is the share of
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

    @property
    def total(self) -> int:
        """The step's tensors at its peak: the five parts, and a resident reference model."""
        return self.parameters + self.optimizer + self.gradients + self.activations + self.transient + self.reference

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


# --------------------------------------------------------------------------------------------------------------
# One simulated step
# --------------------------------------------------------------------------------------------------------------


@dataclass
class _Peak:
    """The largest live memory of a phase once gradients are sharded (see ``_LiveStorages._record``), and what
    it was made of (``grads``: as many bytes as one process holds)."""

    value: float = -1.0
    other: float = 0  # temporaries: neither gradients nor saved activations
    grads: float = 0
    acts: float = 0


class _LiveStorages(TorchDispatchMode):
    """Tracks the bytes of every storage an op creates until it is freed, and each phase's peak.

    Storages that existed before (``known``) are not counted. Gradients (marked when accumulated) and saved
    activations (everything live at the end of a forward) are kept apart, so that a peak can be recomputed for
    sharded gradients and broken down by kind.
    """

    def __init__(self, shard_degree: int, root_parameters: set[int], *, sharded: bool = False) -> None:
        super().__init__()
        self.shard_degree = shard_degree  # processes a parameter is sharded over
        self.root_parameters = root_parameters  # ids of the parameters outside the blocks
        # Under FSDP2 the root's gradients are reduced only when backward ends, so an optimizer stepping in backward
        # (which frees each gradient at once here) takes them only then: until then they are whole on every process.
        self.sharded = sharded
        self._held = 0  # bytes of root gradients freed here in backward that FSDP2 keeps until backward ends
        self.known: set[int] = set()
        self.live: dict[int, int] = {}
        self.grads: set[int] = set()
        self.root_grads: set[int] = set()
        # Storages the optimizer allocates while stepping (its temporaries): as big as a shard under FSDP2.
        self.optimizer_temporaries: set[int] = set()
        self.in_optimizer = False
        self.activations: set[int] = set()
        self.phase = PHASES[0]
        self.peaks = {phase: _Peak() for phase in PHASES}
        self.block_input = 0  # bytes of a block's input (the hidden state of one micro-batch)
        self.flops = 0
        self._live = self._grad = self._root_grad = self._act = self._opt = 0
        self.optimizer_temporaries_in_backward = 0  # the most bytes an optimizer stepping in backward held at once
        self.paused = False  # ops run but are not counted (tracing a compiled block's graphs)

    def _free(self, key: int) -> None:
        nbytes = self.live.pop(key, 0)
        # Discarded, not only subtracted: a later storage may be given the same address.
        if key in self.root_grads and self.sharded and self.phase in BACKWARD_PHASES:
            self.grads.discard(key)
            self.root_grads.discard(key)
            self._held += nbytes  # still counted, whole, until backward ends (``enter``)
            return
        self._live -= nbytes
        if key in self.grads:
            self.grads.discard(key)
            self._grad -= nbytes
        if key in self.root_grads:
            self.root_grads.discard(key)
            self._root_grad -= nbytes
        if key in self.optimizer_temporaries:
            self.optimizer_temporaries.discard(key)
            self._opt -= nbytes
        if key in self.activations:
            self.activations.discard(key)
            self._act -= nbytes

    def _record(self) -> None:
        # Under FSDP2 a block's gradients are reduce-scattered as its backward ends; the root's (embedding,
        # output) only at the end of backward: until the optimizer step they are whole on every process.
        sharded = self._grad if self.phase == "optimizer step" else self._grad - self._root_grad
        grads = self._grad - sharded * (1 - 1 / self.shard_degree)
        value = self._live - self._grad + grads - self._opt * (1 - 1 / self.shard_degree)
        # In a forward, what is live is (mostly) being saved for backward: count it as activations.
        acts = self._live - self._grad if self.phase == "forward" else self._act
        peak = self.peaks[self.phase]
        if value > peak.value:
            self.peaks[self.phase] = _Peak(value, value - grads - acts, grads, acts)

    def enter(self, phase: str) -> None:
        if phase not in BACKWARD_PHASES and self._held:  # backward ended: FSDP2 reduced the root's gradients
            self._record()
            self._live -= self._held
            self._grad -= self._held
            self._root_grad -= self._held
            self._held = 0
        self.phase = phase
        self._record()

    def mark_gradient(self, param: torch.Tensor) -> None:
        key = param.grad.untyped_storage()._cdata
        if key in self.live and key not in self.grads:
            self.grads.add(key)
            self._grad += self.live[key]
            if id(param) in self.root_parameters:
                self.root_grads.add(key)
                self._root_grad += self.live[key]
            if key in self.activations:  # the chunked loss computes the output weight's gradient in forward
                self.activations.discard(key)
                self._act -= self.live[key]

    def mark_activations(self) -> int:
        """Everything live now (but gradients) is a saved activation; returns its bytes."""
        self.activations = set(self.live) - self.grads
        self._act = sum(self.live[key] for key in self.activations)
        return self._act

    @contextlib.contextmanager
    def pausing(self) -> Iterator[None]:
        """Run ops without counting them."""
        self.paused = True
        try:
            yield
        finally:
            self.paused = False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if self.paused:
            return func(*args, **kwargs)
        out = _assume_every_position_a_target(func, args, kwargs)
        if out is None:
            out = func(*args, **kwargs)
        # FLOPs as torch.utils.flop_counter counts them (matrix multiplies and attention); its FlopCounterMode
        # itself is not used: its module tracking keeps tensors alive that the step would have freed.
        count = flop_registry.get(func.overloadpacket)
        if count is not None:
            self.flops += count(*args, **kwargs, out_val=out)
        for leaf in tree_flatten(out)[0]:
            if isinstance(leaf, torch.Tensor):
                storage = leaf.untyped_storage()
                key = storage._cdata
                if key not in self.live and key not in self.known and storage.nbytes() > 0:
                    self.live[key] = storage.nbytes()
                    self._live += storage.nbytes()
                    if self.in_optimizer:
                        self.optimizer_temporaries.add(key)
                        self._opt += storage.nbytes()
                        if self.phase in BACKWARD_PHASES:
                            self.optimizer_temporaries_in_backward = max(self.optimizer_temporaries_in_backward,
                                                                         self._opt)
                    # The Python storage object lives exactly as long as its memory (PyObject preservation).
                    weakref.finalize(storage, self._free, key)
        self._record()
        return out


def _assume_every_position_a_target(func: Any, args: tuple, kwargs: dict) -> Optional[torch.Tensor]:
    """Boolean-mask indexing has a data-dependent size, which fake tensors cannot have: every mask is taken as
    all true (every position a target: the loss's worst case). Returns the op's result, or None to run it."""
    if func is torch.ops.aten.index.Tensor:
        source, indices = args
        if len(indices) == 1 and indices[0] is not None and indices[0].dtype == torch.bool:
            return source.reshape(-1, *source.shape[indices[0].dim():]).clone()
    if func in (torch.ops.aten.index_put.default, torch.ops.aten.index_put_.default,
                torch.ops.aten._index_put_impl_.default):
        target, indices, values = args[:3]
        if len(indices) == 1 and indices[0] is not None and indices[0].dtype == torch.bool:
            result = values.reshape(target.shape).clone()
            return result if func is torch.ops.aten.index_put.default else target.copy_(result)
    return None


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype) -> Iterator[None]:
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


def _nbytes(tensors: Sequence[torch.Tensor]) -> int:
    """Bytes of the distinct storages of ``tensors`` (a tied weight once)."""
    storages = {t.untyped_storage()._cdata: t.untyped_storage().nbytes() for t in tensors}
    return sum(storages.values())


def _shapes(tensors: Sequence[torch.Tensor]) -> tuple[tuple[int, ...], ...]:
    """The shapes of ``tensors``, one per distinct storage (a tied weight once)."""
    return tuple({t.untyped_storage()._cdata: tuple(t.shape) for t in tensors}.values())


@dataclass(frozen=True)
class _Simulation:
    """What one simulated step at one depth measured."""

    n_blocks: int
    parameters: int
    optimizer: int
    batch: int
    saved_activations: int
    flops: int
    peaks: dict[str, _Peak]
    block_parameters: int  # the largest block's parameters
    root_parameters: int  # parameters outside the blocks
    # The largest FSDP2 group outside the blocks: one of the family's shard groups (embeddings; final norm and
    # output), or the root with what they leave (all of root_parameters for a model without groups).
    largest_outer_group: int
    root_shapes: tuple[tuple[int, ...], ...]  # each parameter outside the blocks (a tied weight once)
    block_shapes: tuple[tuple[int, ...], ...]  # each parameter of one block
    block_input: int  # bytes of a block's input, one micro-batch's hidden state
    logits: int  # bytes of one micro-batch's whole logits in float32 ([rows, seq_len, vocab])
    varlen_kv_copy: int = 0  # bytes of one block's K/V copies for varlen_attn, one micro-batch (Workload.varlen)
    optimizer_temporaries_in_backward: int = 0  # the most a step in backward held at once, unsharded


def _simulate(
    build_model: Callable[[], nn.Module],
    make_optimizer: Callable[[Any], torch.optim.Optimizer],
    mode: str,
    option: Any,
    n_blocks: Optional[int],
    workload: Workload,
) -> _Simulation:
    """One step of the recipe under fake tensors with its first ``n_blocks`` blocks (all when None)."""
    with FakeTensorMode(), _default_dtype(workload.dtype.torch):
        model = build_model()
        blocks = transformer_blocks(model)
        if n_blocks is not None:
            del blocks[n_blocks:]  # every block alike: a shallower model of the same blocks
        apply_ac_plan(model, _plan(mode, option, len(blocks)))
        params = list(model.parameters())
        in_blocks = {id(p) for block in blocks for p in block.parameters()}
        sharded = workload.world_size > 1 or bool(cpu_offload.shard_options(workload.settings.cpu_offload))
        tracker = _LiveStorages(workload.shard_degree, {id(p) for p in params if id(p) not in in_blocks},
                                sharded=sharded)
        if workload.compiled:
            _simulate_compiled_blocks(blocks, tracker)
        # Registered before an optimizer in backward registers its own: a gradient is seen before it is freed.
        hooks = [p.register_post_accumulate_grad_hook(tracker.mark_gradient) for p in params]
        # The run's step with the features' mechanisms, as run/assemble.py applies them (the optimizer the state's
        # feature can simulate).
        make_optimizer = optimizer_state.planner_optimizer(workload.settings.optimizer_state, make_optimizer)
        stepper = build_optimizer(make_optimizer, model, in_backward=workload.settings.optimizer_in_bwd)
        objective, reference = _objective(build_model, workload, n_blocks)
        optimizers = stepper.optimizers_to_checkpoint()
        _allocate_optimizer_state(optimizers)
        hooks += _phase_hooks(blocks, tracker)
        for opt in optimizers:
            hooks.append(opt.register_step_pre_hook(lambda *_: setattr(tracker, "in_optimizer", True)))
            hooks.append(opt.register_step_post_hook(lambda *_: setattr(tracker, "in_optimizer", False)))
        family = family_of(model)
        vocab = family.hf.architecture(family.args_of(model))["vocab_size"] if family is not None else 2
        micro_batches = []
        for _ in range(min(workload.gradient_accumulation_steps, 2)):  # gradients live across the second
            tokens = torch.randint(0, vocab, (workload.rows, workload.seq_len))
            # Every position a target (the loss's worst case), counted on the host as the collate code does.
            micro_batches.append({"tokens": tokens, "labels": torch.randint(0, vocab, tokens.shape),
                                  "target_count": torch.tensor(tokens.numel())})
            if workload.preference is not None and reference is None:  # precomputed: they come with the batch
                micro_batches[-1]["reference_logps"] = torch.zeros(workload.rows)
        states = [v for opt in optimizers for s in opt.state.values() for v in s.values() if isinstance(v, torch.Tensor)]
        inputs = [t for batch in micro_batches for t in batch.values()]
        frozen = [*reference.parameters(), *reference.buffers()] if reference is not None else []
        tracker.known = {t.untyped_storage()._cdata for t in [*params, *states, *inputs, *model.buffers(), *frozen]}
        saved: list[int] = []

        def after_forward(i: int) -> None:
            if i == 0:
                saved.append(tracker.mark_activations())
            tracker.enter("loss backward")

        with tracker:
            accumulate_gradients(model, stepper, micro_batches, scale=1.0, objective=objective,
                                 after_forward=after_forward)
            tracker.enter("optimizer step")
            stepper.update(model, workload.clip_grad_norm)
        for hook in hooks:
            hook.remove()
        return _Simulation(
            n_blocks=len(blocks), parameters=_nbytes(params), optimizer=_nbytes(states), batch=_nbytes(inputs),
            saved_activations=saved[0], flops=tracker.flops, peaks=tracker.peaks,
            block_parameters=max(_nbytes(list(block.parameters())) for block in blocks),
            root_parameters=_nbytes([p for p in params if id(p) not in in_blocks]),
            largest_outer_group=_largest_outer_group(model, in_blocks),
            root_shapes=_shapes([p for p in params if id(p) not in in_blocks]),
            block_shapes=_shapes(list(blocks[0].parameters())),
            block_input=tracker.block_input,
            logits=workload.rows * workload.seq_len * vocab * 4,
            varlen_kv_copy=_varlen_kv_copy(blocks[0], workload) if workload.varlen else 0,
            optimizer_temporaries_in_backward=tracker.optimizer_temporaries_in_backward,
        )


def _objective(build_model: Callable[[], nn.Module], workload: Workload,
               n_blocks: Optional[int]) -> tuple[Any, Optional[nn.Module]]:
    """The step's objective, as the recipe builds it: the token loss (chunked as ``loss_chunks`` says), or for a
    preference step the DPO loss, with a reference model of the simulated depth when it is resident (its
    parameters, counted apart as ``MemoryEstimate.reference``, are not the step's allocations; its forward is)."""
    chunks = workload.settings.loss_chunks
    if workload.preference is None:
        return loss_objective(chunks), None
    from torchtune_ac.training.dpo import DPOConfig, DPOObjective, freeze_reference

    reference = None
    if workload.preference.resident_reference:
        reference = freeze_reference(build_model())
        if n_blocks is not None:
            del transformer_blocks(reference)[n_blocks:]
    return DPOObjective(DPOConfig(), n_chunks=chunks, reference=reference), reference


def _varlen_kv_copy(block: nn.Module, workload: Workload) -> int:
    """Bytes of the K/V copies one block's attention makes for ``varlen_attn`` on this torch, one micro-batch."""
    tokens = workload.rows * workload.seq_len
    return sum(varlen_kv_copy_bytes(tokens, m.n_heads, m.n_kv_heads, m.head_dim, workload.dtype.torch)
               for m in block.modules() if isinstance(m, Attention))


log = logging.getLogger("torchtune_ac.memory")
_WARNED: set[str] = set()  # what was said once in this process


class _CompiledForward:
    """A block's forward as its compiled form runs: AOTAutograd's graphs of forward and backward, run op by op.

    ``block.compile()`` hands the block to inductor, which traces forward and backward as one graph (AOTAutograd,
    with inductor's decompositions) and splits it with its min-cut partitioner: the forward saves fewer tensors than
    eager (the results of pointwise ops, the norms' float32 copies, are recomputed in backward from what is saved).
    The same trace and partition, with the graphs run op by op instead of inductor's kernels, lets the tracker see
    compile's saved set; what fusion saves inside a graph (a block's temporaries) is not modelled. On
    ``llama3_2_1b`` (4 x 2048 tokens, bf16) a block saves 710 MiB compiled against 966 MiB eager; on an H100
    the compiled step without AC reserved 3.2 GiB less than the eager simulation planned.

    Blocks alike share one trace (``_alike``: their modules' classes and plain attributes, an attention's window
    among them, and their parameters' shapes), for calls alike (the inputs' shapes, dtypes and whether they require
    a gradient, the values of the other arguments, grad mode): AOTAutograd specialises its graphs on all of these
    and checks none of them when called again. A trace is made at its first call with the tracker paused (tracing
    runs the ops of forward and backward once, which the step does not), then run counted.
    A block the trace cannot take (a model or torch it does not support) is planned as eager, which keeps more for
    backward, with a warning, once.
    """

    def __init__(self, block: nn.Module, traced: dict, tracker: _LiveStorages) -> None:
        self.block = block
        self.tracker = tracker
        self.eager = block.forward
        self.signature = inspect.signature(self.eager)
        self.key = _alike(block)
        self.traced = traced  # {(block key, call key): [the traced function, traced: True, failed: None]}

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        bound = self.signature.bind(*args, **kwargs)
        bound.apply_defaults()
        leaves, spec = tree_flatten((bound.args, bound.kwargs))
        call = (str(spec), torch.is_grad_enabled(),
                tuple((tuple(t.shape), t.dtype, t.device, t.requires_grad) if isinstance(t, torch.Tensor)
                      else _plain(t) for t in leaves))
        shared = self.traced.setdefault((self.key, call), [None, False])
        state = {f"block.{name}": t for name, t in [*self.block.named_parameters(), *self.block.named_buffers()]}
        if shared[1] is None:
            return self.eager(*args, **kwargs)
        if not shared[1]:
            try:
                shared[0] = _aot_block(self.block, self.eager)  # this block's code, any alike block's state
                with self.tracker.pausing():
                    shared[0](state, *bound.args, **bound.kwargs)  # traced and run once, uncounted; dropped
            except Exception as err:  # noqa: BLE001 - any failure of the trace: planned as eager, and said
                shared[1] = None
                message = (f"compile: true: the planner could not trace {type(self.block).__name__} as compiled "
                           f"({type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}); it plans the "
                           "block as eager, which keeps more for backward than the compiled block will")
                if message not in _WARNED:
                    _WARNED.add(message)
                    log.warning(message)
                return self.eager(*args, **kwargs)
            shared[1] = True
        return shared[0](state, *bound.args, **bound.kwargs)


def _plain(value: Any) -> Any:
    """``value`` as part of a key: itself where it can be one, else its repr."""
    try:
        hash(value)
    except TypeError:
        return repr(value)
    return value


def _alike(block: nn.Module) -> tuple:
    """What makes two blocks compute the same graph on the same inputs: each module's class and plain attributes (an
    attention's window, a norm's epsilon, whether it trains), and the parameters' and buffers' shapes and dtypes."""
    modules = tuple((name, type(m), tuple(sorted((k, _plain(v)) for k, v in vars(m).items()
                                                 if not k.startswith("_") and k != "forward")))
                    for name, m in block.named_modules())
    tensors = tuple((name, tuple(t.shape), t.dtype) for name, t in [*block.named_parameters(), *block.named_buffers()])
    return modules, tensors


def _aot_block(block: nn.Module, forward: Callable[..., Any]) -> Callable[..., Any]:
    """``forward`` of ``block`` (its state an argument) traced and partitioned as inductor would, run op by op.

    As inductor partitions: its joint-graph passes first (``compile_fx.partition_fn``: pattern rewrites that change
    what the forward computes, and so what it can save), then the min-cut partitioner told which inputs live for the
    whole step (the block's parameters and buffers, which Dynamo marks static): saving one of those costs nothing."""
    from torch._functorch.aot_autograd import aot_function, make_boxed_func
    from torch._inductor import compile_fx
    from torch._inductor.decomposition import select_decomp_table
    from torch.func import functional_call

    class Body(nn.Module):  # the block's own forward, called without the block's hooks (the tracker's phases)
        def __init__(self) -> None:
            super().__init__()
            self.block = block

        def forward(self, *args: Any, **kwargs: Any) -> Any:
            return forward(*args, **kwargs)

    body = Body()

    def run_ops(graph: torch.fx.GraphModule, _inputs: Any) -> Callable[..., Any]:
        return make_boxed_func(graph.forward)

    # The flat inputs start with the state's tensors, in the order of the dict the traced function is called with
    # (``_CompiledForward``: parameters, then buffers).
    n_state = len(list(block.parameters())) + len(list(block.buffers()))

    def partition(joint: torch.fx.GraphModule, joint_inputs: Any, **kwargs: Any) -> Any:
        kwargs["static_lifetime_input_indices"] = list(range(n_state))
        return compile_fx.partition_fn(joint, joint_inputs, **kwargs)

    return aot_function(lambda state, *args, **kwargs: functional_call(body, state, args, kwargs),
                        fw_compiler=run_ops, bw_compiler=run_ops, decompositions=select_decomp_table(),
                        partition_fn=partition)


def _simulate_compiled_blocks(blocks: nn.ModuleList, tracker: _LiveStorages) -> None:
    """Run each block without AC as its compiled form does (``_CompiledForward``). A checkpointed block keeps only
    its inputs, compiled or not, and stays as it is (per-op AC's saved set is its policy's)."""
    traced: dict = {}
    for block in blocks:
        if not is_checkpointed(block):
            block.forward = _CompiledForward(block, traced, tracker)


def _largest_outer_group(model: nn.Module, in_blocks: set[int]) -> int:
    """Bytes of the largest FSDP2 group outside the blocks, as ``shard_model`` groups them."""
    grouped: set[int] = set()
    sizes = []
    for group in shard_groups(model):
        params = [p for module in group for p in module.parameters()]
        grouped.update(id(p) for p in params)
        sizes.append(_nbytes(params))
    rest = [p for p in model.parameters() if id(p) not in in_blocks and id(p) not in grouped]
    return max([*sizes, _nbytes(rest)])


def _phase_hooks(blocks: nn.ModuleList, tracker: _LiveStorages) -> list[Any]:
    """Move the tracker from phase to phase: the last block's output gradient starts the blocks' backward, the
    first block's input gradient ends it; a new forward starts with the first block's input."""

    def first_input(module: nn.Module, args: tuple) -> None:
        tracker.enter("forward")
        x = args[0]
        tracker.block_input = x.untyped_storage().nbytes()
        if x.requires_grad:
            x.register_hook(lambda grad: tracker.enter("rest of backward"))

    def last_output(module: nn.Module, args: tuple, output: torch.Tensor) -> None:
        output.register_hook(lambda grad: tracker.enter("blocks backward"))

    return [blocks[0].register_forward_pre_hook(first_input), blocks[-1].register_forward_hook(last_output)]


@torch.no_grad()
def _allocate_optimizer_state(optimizers: Sequence[torch.optim.Optimizer]) -> None:
    """Give every parameter its optimizer state, as after a first step (a step on zero gradients)."""
    for opt in optimizers:
        for group in opt.param_groups:
            for param in group["params"]:
                param.grad = torch.zeros_like(param)
        opt.step()
        opt.zero_grad(set_to_none=True)


# --------------------------------------------------------------------------------------------------------------
# Estimates
# --------------------------------------------------------------------------------------------------------------


def _extrapolate(a: float, b: float, depth_a: int, depth_b: int, depth: int) -> float:
    return a + (b - a) * (depth - depth_a) / (depth_b - depth_a)


def _estimate(plan: ACPlan, shallow: _Simulation, deep: Optional[_Simulation], workload: Workload) -> MemoryEstimate:
    """The estimate at ``plan.n_layers`` blocks from one simulation at that depth (``deep`` None) or two
    shallower ones, with FSDP2's share added (``extra_flops`` is left at 0: see ``estimate_memory``)."""
    n, depth = workload.shard_degree, plan.n_layers

    def at_depth(get: Callable[[_Simulation], float]) -> float:
        if deep is None:
            return get(shallow)
        return _extrapolate(get(shallow), get(deep), shallow.n_blocks, deep.n_blocks, depth)

    peaks = {phase: tuple(at_depth(lambda s, p=phase, f=f: getattr(s.peaks[p], f)) for f in ("value", "other", "grads", "acts"))
             for phase in PHASES}
    phase = max(PHASES, key=lambda p: peaks[p][0])
    _, other, grads, acts = peaks[phase]
    parameters = at_depth(lambda s: s.parameters)
    sharded = workload.world_size > 1 or bool(cpu_offload.shard_options(workload.settings.cpu_offload))
    gathered = 0
    fsdp_extra = 0.0
    if sharded:
        root = shallow.root_parameters
        blocks = parameters - root if not workload.fsdp.reshard_after_forward else 2 * shallow.block_parameters
        gathered = root + blocks
        reduce_factor = workload.fsdp.resolved_reduce_dtype(workload.dtype).torch.itemsize / workload.dtype.torch.itemsize
        # Gathered parameters beyond the resident shards (the groups outside the blocks counted gathered throughout),
        # and the reduce-scatter input of the largest group.
        largest_group = max(shallow.block_parameters, shallow.largest_outer_group)
        fsdp_extra = gathered * (n - 1) / n + largest_group * reduce_factor
    # Tensor parallelism splits every parameter (and its gradient and optimizer state) over tp more processes, and
    # the activations of the split layers: the simulation ran the whole model, so its parts are divided by tp, and
    # what stays whole on every rank of a group is added back (tensor_parallel_share).
    tp = workload.parallelism.tensor
    device = {
        "parameters": parameters / n / tp,
        "optimizer": at_depth(lambda s: s.optimizer) / n / tp,
        "gradients": grads / tp,
        "activations": acts / tp,
        "transient": (other + fsdp_extra) / tp + shallow.batch + workload.blas_workspaces,
    }
    if tp > 1:
        for category, nbytes in tensor_parallel_share(plan, shallow, workload, phase).items():
            device[category] += nbytes
    device["transient"] += in_backward_stream_pool(shallow, workload, sharded) / n / tp
    if shallow.varlen_kv_copy:
        # varlen_attn saves its K/V copies for backward: a block without AC keeps them until its backward; the block
        # running (or recomputing) holds its own as it goes (a group's rank, its heads' share).
        copy = shallow.varlen_kv_copy / tp
        if phase != "optimizer step":
            device["activations"] += copy * (depth - len(plan.checkpointed_blocks))
        device["transient"] += copy
    # What the simulation cannot show, as each feature declares it, in the features' order: each sees the estimate
    # with the earlier ones' costs.
    shapes = shallow.root_shapes + shallow.block_shapes * depth
    host: dict[str, float] = {}
    for feature, setting in workload.feature_settings():
        sizes = ModelSizes(parameters=math.ceil(parameters), root_parameters=shallow.root_parameters,
                           largest_block=shallow.block_parameters,
                           optimizer_state=math.ceil(at_depth(lambda s: s.optimizer)), world_size=n * tp,
                           shapes=shapes, dtype=workload.dtype.torch, sharded=sharded,
                           gathered_parameters=math.ceil(gathered / tp),
                           checkpointed_blocks=len(plan.checkpointed_blocks), block_input=shallow.block_input,
                           max_gradients=math.ceil(max(peak[2] for peak in peaks.values())),
                           so_far={category: math.ceil(nbytes) for category, nbytes in device.items()})
        cost = feature.planner_cost(setting, sizes)
        for category, nbytes in cost.device.items():
            device[category] += nbytes
        for category, nbytes in cost.host.items():
            host[category] = host.get(category, 0) + nbytes
    # A resident reference: the policy's parameters again, sharded alike; kept in host memory with CPU offload.
    reference = parameters / n / tp if workload.preference is not None and workload.preference.resident_reference else 0
    if reference and workload.settings.cpu_offload:
        host["reference"] = reference
        reference = 0
    return MemoryEstimate(
        plan=plan,
        reference=math.ceil(reference),
        parameters=math.ceil(device["parameters"]),
        optimizer=math.ceil(device["optimizer"]),
        gradients=math.ceil(device["gradients"]),
        activations=math.ceil(device["activations"]),
        transient=math.ceil(device["transient"]),
        saved_activations=math.ceil(at_depth(lambda s: s.saved_activations)),
        extra_flops=0.0,
        peak_phase=phase,
        flops=at_depth(lambda s: s.flops),
        host=math.ceil(sum(host.values())),
        host_parts={category: math.ceil(nbytes) for category, nbytes in host.items()},
    )


def in_backward_stream_pool(shallow: _Simulation, workload: Workload, sharded: bool) -> int:
    """Unsharded bytes a GPU holds apart for the optimizer stepping in backward under FSDP2: the most its step of
    one parameter holds at once (its temporaries), 0 elsewhere.

    FSDP2 calls the parameters' gradient hooks on its reduce-scatter stream (HSDP: its all-reduce stream), so the
    step's temporaries come from that stream's pool of the caching allocator, which the default stream's
    allocations cannot reuse (nor the other way round): the simulation, one pool, would let the two share bytes.
    The step stays on that stream, overlapping the next block's backward (docs/memory.md, "The step in backward
    and FSDP2's streams"). Its state, allocated there on the first step, is counted as the optimizer's. With CPU
    offload the step runs on the host, on the host's shards."""
    if not (workload.cuda and sharded and workload.settings.optimizer_in_bwd) or workload.settings.cpu_offload:
        return 0
    return shallow.optimizer_temporaries_in_backward


def tensor_parallel_share(plan: ACPlan, shallow: _Simulation, workload: Workload, phase: str) -> dict[str, float]:
    """What tensor parallelism leaves whole on every rank of a group, beyond the 1/tp share of the simulated step.

    Sequence parallelism splits a block's input, its norms and residuals along the sequence, but the attention and
    the MLP each gather their normed input whole (``[b, s, dim]``): a block without AC keeps both for backward (a
    checkpointed one keeps only its split input), and the block running or recomputing holds them. The whole
    logits (``loss_chunks: 1``) are gathered on every rank; the chunked loss computes on vocabulary shards.
    """
    tp = workload.parallelism.tensor
    whole = 1 - 1 / tp
    gathered_inputs = 2 * shallow.block_input * whole
    share = {"activations": 0.0, "transient": gathered_inputs}
    if phase != "optimizer step":
        share["activations"] = gathered_inputs * (plan.n_layers - len(plan.checkpointed_blocks))
    if workload.settings.loss_chunks == 1:
        share["transient"] += shallow.logits * whole
    return share


def suggested_tensor_parallel_degree(model: nn.Module, world_size: int, gpus_per_node: int = 8) -> Optional[int]:
    """The largest tensor-parallel degree worth suggesting for ``model`` on ``world_size`` processes: within one
    node's GPUs (``gpus_per_node``), dividing the world size, and one the model's plan can split (its heads, key/
    value heads and MLP width); None when there is none above 1 (or the model's family has no plan)."""
    family = family_of(model)
    if family is None or family.tensor_parallel_plan is None:
        return None
    plan = family.tensor_parallel_plan(family.args_of(model))
    return next((degree for degree in range(min(gpus_per_node, world_size), 1, -1)
                 if world_size % degree == 0 and tensor_parallel_problem(plan, degree) is None), None)


def _depths(plan: ACPlan) -> tuple[int, Optional[int]]:
    """The two depths that repeat the plan's pattern (the second None: simulate the whole model)."""
    period = plan.option if isinstance(plan.option, int) else 1
    first = period * max(1, math.ceil(2 / period))
    second = 2 * first
    return (first, second) if second < plan.n_layers else (plan.n_layers, None)


def estimate_memory(
    build_model: Callable[[], nn.Module],
    make_optimizer: Callable[[Any], torch.optim.Optimizer],
    workload: Workload,
    plans: Optional[Sequence[ACPlan]] = None,
) -> list[MemoryEstimate]:
    """Estimate the memory per process of a training step for each AC plan (default: ``candidate_plans``).

    Args:
        build_model: builds the model on the current default device (called under fake tensors: no memory).
        make_optimizer: the config's optimizer, called with parameters.
        workload: what one process does per step.
        plans: the AC plans to estimate, resolved for the model's layer count.

    Returns:
        One estimate per plan, in order; ``extra_flops`` is relative to the same step without AC.
    """
    if plans is None:
        with FakeTensorMode():
            plans = candidate_plans(len(transformer_blocks(build_model())))
    plans = list(plans)
    cache: dict[tuple, _Simulation] = {}
    none = _plan("none", None, plans[0].n_layers)
    baseline = _estimate_plan(build_model, make_optimizer, none, workload, cache).flops
    return [dataclasses.replace(estimate, extra_flops=estimate.flops / baseline - 1)
            for estimate in (_estimate_plan(build_model, make_optimizer, plan, workload, cache) for plan in plans)]


def _alternatives(feature: Feature, setting: Any, device: torch.device) -> list[Alternative]:
    """The feature's alternatives that can run on ``device`` (a CUDA-only feature suggests nothing for a CPU run)."""
    usable = []
    for alternative in feature.alternatives(setting):
        try:
            feature.check_device(alternative.setting, device)
        except UnavailableError:
            continue
        usable.append(alternative)
    return usable


def switch_ablation(
    build_model: Callable[[], nn.Module],
    make_optimizer: Callable[[Any], torch.optim.Optimizer],
    workload: Workload,
    plan: ACPlan,
    device: torch.device,
    fixed: int = 0,
) -> list[tuple[str, MemoryEstimate]]:
    """The estimate of ``plan`` as ``workload`` has its features, then with each feature's first alternative that runs
    on ``device`` added to the ones before, in the features' order (torchtune's ablation, from the planner):
    ``(label, estimate)`` rows, the first labelled ``as configured``. ``fixed`` is the process's fixed cost
    (``MemoryEstimate.fixed``)."""
    rows = [("as configured", dataclasses.replace(_estimate_plan(build_model, make_optimizer, plan, workload, {}),
                                                  fixed=fixed))]
    for feature, setting in workload.feature_settings():
        alternatives = _alternatives(feature, setting, device)
        if not alternatives:
            continue
        alternative = alternatives[0]
        workload = workload.with_settings({feature.name: alternative.setting}, **alternative.workload_changes)
        estimate = _estimate_plan(build_model, make_optimizer, plan, workload, {})
        rows.append((f"+ {alternative.label}", dataclasses.replace(estimate, fixed=fixed)))
    return rows


def choose_plan(
    build_model: Callable[[], nn.Module],
    make_optimizer: Callable[[Any], torch.optim.Optimizer],
    workload: Workload,
    budget_gib: float,
    n_layers: int,
    fixed: int = 0,
    device: torch.device = torch.device("cpu"),
) -> MemoryEstimate:
    """``ac_mode: auto``: the plan with the least recompute whose estimate fits ``budget_gib`` per process.

    Plans are tried in ``candidate_plans`` order (none, per-op, every k-th block, full) and the first that fits
    wins, so no more plans are simulated than needed. What fits is the step's estimate and the process's fixed
    cost ``fixed`` (bytes, measured when the run starts: see ``MemoryEstimate.device``). ``device`` is where the
    run trains: only the features' alternatives that run there are suggested.

    Raises:
        UserError: no plan fits; one line saying how many GiB are missing even with full AC, and what each knob
            (batch size, sequence length, more processes, and each memory feature's ``alternatives``) would bring
            the full-AC estimate to.
    """
    budget = budget_gib * GiB
    cache: dict[tuple, _Simulation] = {}
    plans = candidate_plans(n_layers)
    estimate = None
    for plan in plans:
        estimate = dataclasses.replace(_estimate_plan(build_model, make_optimizer, plan, workload, cache), fixed=fixed)
        if estimate.device <= budget:
            return estimate
    full = plans[-1]
    knobs = []
    alternatives = []
    if workload.batch_size > 1:
        alternatives.append((f"batch_size={workload.batch_size // 2}", {"batch_size": workload.batch_size // 2}))
    if workload.seq_len > 1:
        alternatives.append((f"max_seq_len={workload.seq_len // 2}", {"seq_len": workload.seq_len // 2}))
    parallelism = workload.parallelism
    alternatives.append((f"{2 * workload.world_size} processes",
                         {"parallelism": dataclasses.replace(parallelism, world_size=2 * workload.world_size)}))
    if parallelism.tensor == 1:
        with FakeTensorMode():
            degree = suggested_tensor_parallel_degree(build_model(), workload.world_size)
        if degree is not None:
            alternatives.append((f"tensor_parallel_dim={degree}",
                                 {"parallelism": dataclasses.replace(parallelism, tensor=degree)}))
    for feature, setting in workload.feature_settings():
        for alternative in _alternatives(feature, setting, device):
            alternatives.append((alternative.label, {"settings": {feature.name: alternative.setting},
                                                     **alternative.workload_changes}))
    for label, change in alternatives:
        change = dict(change)
        changed = workload.with_settings(change.pop("settings", {}), **change)
        total = _estimate_plan(build_model, make_optimizer, full, changed, {}).total + fixed
        knobs.append(f"{label} {total / GiB:.2f} GiB")
    own = f" ({fixed / GiB:.2f} of them the process's own)" if fixed else ""
    raise UserError(
        f"ac_mode=auto: no plan fits ac_memory_budget_gib={budget_gib:g}: even full AC needs an estimated "
        f"{estimate.device / GiB:.2f} GiB per process{own}, {(estimate.device - budget) / GiB:.2f} GiB too many; "
        f"with full AC, {', '.join(knobs)} (see tune plan)"
    )


def _estimate_plan(build_model, make_optimizer, plan: ACPlan, workload: Workload,
                   cache: dict[tuple, _Simulation]) -> MemoryEstimate:
    """One plan's estimate (its extra FLOPs left at 0: no baseline is simulated), reusing ``cache``."""

    def simulate(depth: Optional[int]) -> _Simulation:
        key = (plan.mode.value, plan.option, depth, workload)
        if key not in cache:
            cache[key] = _simulate(build_model, make_optimizer, plan.mode.value, plan.option, depth, workload)
        return cache[key]

    first, second = _depths(plan)
    return _estimate(plan, simulate(first if second else None), simulate(second) if second else None, workload)
