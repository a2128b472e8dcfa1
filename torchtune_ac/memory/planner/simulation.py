"""One simulated step: the model and the recipe's own step run under fake tensors, every storage they allocate
recorded by phase (``_simulate``); compiled blocks as inductor partitions them (``_CompiledForward``)."""

from __future__ import annotations

import contextlib
import inspect
import logging
import weakref
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Optional, Sequence

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten
from torch.utils.flop_counter import flop_registry

from torchtune_ac.memory import cpu_offload, optimizer_state
from torchtune_ac.memory.chunked_loss import loss_objective, runs_target_head
from torchtune_ac.memory.optimizer_in_backward import build_optimizer
from torchtune_ac.models.attention import varlen_kv_copy_bytes
from torchtune_ac.models.families import family_of, shard_groups, transformer_blocks
from torchtune_ac.models.llama import Attention
from torchtune_ac.activation_checkpointing.mechanism import (
    apply_ac_plan,
    is_checkpointed,
)
from torchtune_ac.training.step import accumulate_gradients
from torchtune_ac.memory.planner.experts import simulate_expert_parallel
from torchtune_ac.memory.planner.workload import (
    PHASES,
    BACKWARD_PHASES,
    Workload,
    _plan,
)

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

    def __init__(self, shard_degree: int, root_parameters: set[int], *, sharded: bool = False,
                 expert_parameters: Sequence[torch.Tensor] = (), expert_shard_degree: Optional[int] = None) -> None:
        super().__init__()
        self.shard_degree = shard_degree  # processes a parameter is sharded over
        self.root_parameters = root_parameters  # ids of the parameters outside the blocks
        # Under expert parallelism the experts this process holds are sharded over fewer processes (expert_shard):
        # their gradients, and what the optimizer computes from them (``expert_temporaries``), are divided by that
        # degree instead. Told by data flow: an op's output is an expert's when an input is an expert's parameter,
        # gradient, optimizer state (``expert_sources``, storages) or such an output.
        self.expert_parameters = {id(p) for p in expert_parameters}
        self.expert_sources = {p.untyped_storage()._cdata for p in expert_parameters}
        self.expert_shard_degree = expert_shard_degree or shard_degree
        self.expert_grads: set[int] = set()
        self.expert_temporaries: set[int] = set()
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
        self._expert_grad = self._expert_opt = 0
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
        if key in self.expert_grads:
            self.expert_grads.discard(key)
            self._expert_grad -= nbytes
        if key in self.optimizer_temporaries:
            self.optimizer_temporaries.discard(key)
            self._opt -= nbytes
        if key in self.expert_temporaries:
            self.expert_temporaries.discard(key)
            self._expert_opt -= nbytes
        if key in self.activations:
            self.activations.discard(key)
            self._act -= nbytes

    def _record(self) -> None:
        # Under FSDP2 a block's gradients are reduce-scattered as its backward ends; the root's (embedding,
        # output) only at the end of backward: until the optimizer step they are whole on every process.
        sharded = self._grad if self.phase == "optimizer step" else self._grad - self._root_grad
        n, n_experts = self.shard_degree, self.expert_shard_degree
        grads = self._grad - (sharded - self._expert_grad) * (1 - 1 / n) - self._expert_grad * (1 - 1 / n_experts)
        value = (self._live - self._grad + grads - (self._opt - self._expert_opt) * (1 - 1 / n)
                 - self._expert_opt * (1 - 1 / n_experts))
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

    def _is_experts(self, tensor: Any) -> bool:
        if not isinstance(tensor, torch.Tensor):
            return False
        key = tensor.untyped_storage()._cdata
        return key in self.expert_sources or key in self.expert_grads or key in self.expert_temporaries

    def _from_experts(self, leaf: torch.Tensor, func: Any, args: tuple, kwargs: dict, out: Any) -> bool:
        """Whether ``leaf``, an output of ``func``, was computed from an expert's tensors. A list op (the
        optimizers' ``_foreach_*``) computes its i-th output from the i-th tensor of each list argument (and any
        tensor argument outside the lists); any other op from all of its tensor arguments."""
        inputs = [*args, *kwargs.values()]
        if isinstance(out, (list, tuple)):
            position = next((i for i, t in enumerate(out) if t is leaf), None)
            lists = [a for a in inputs if isinstance(a, (list, tuple)) and len(a) == len(out)]
            if position is not None and lists:
                return (any(self._is_experts(a[position]) for a in lists)
                        or any(self._is_experts(a) for a in inputs if not isinstance(a, (list, tuple))))
        return any(self._is_experts(t) for t in tree_flatten(inputs)[0])

    def mark_gradient(self, param: torch.Tensor) -> None:
        key = param.grad.untyped_storage()._cdata
        if key in self.live and key not in self.grads:
            self.grads.add(key)
            self._grad += self.live[key]
            if id(param) in self.root_parameters:
                self.root_grads.add(key)
                self._root_grad += self.live[key]
            if id(param) in self.expert_parameters:
                self.expert_grads.add(key)
                self._expert_grad += self.live[key]
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
        elif func in _GROUPED_MMS:  # which flop_counter has no formula for: [N, K] x [E, K, M], or [K, N] x [N, M]
            self.flops += 2 * args[0].numel() * args[1].shape[-1]
        if func is _WAIT_TENSOR:
            # A collective's wait returns its input in a run (the same memory); on fake tensors its output has a
            # storage of its own, which takes over the input's bytes.
            self._free(args[0].untyped_storage()._cdata)
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
                        if self._from_experts(leaf, func, args, kwargs, out):
                            self.expert_temporaries.add(key)
                            self._expert_opt += storage.nbytes()
                        if self.phase in BACKWARD_PHASES:
                            # As many bytes as the shard degree divides into a process's: an expert's temporaries
                            # are shards over expert_shard.
                            held = self._opt - self._expert_opt + self._expert_opt * (self.shard_degree
                                                                                    / self.expert_shard_degree)
                            self.optimizer_temporaries_in_backward = max(self.optimizer_temporaries_in_backward,
                                                                         held)
                    # The Python storage object lives exactly as long as its memory (PyObject preservation).
                    weakref.finalize(storage, self._free, key)
        self._record()
        return out


# torch's grouped matmul, and ours of its kernel in float32 (``models/moe.py``).
_GROUPED_MMS = (torch.ops.aten._grouped_mm.default, torch.ops.torchtune_ac.grouped_mm.default)
_WAIT_TENSOR = torch.ops._c10d_functional.wait_tensor.default if torch.distributed.is_available() else None


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
    """Bytes of the distinct storages of ``tensors`` (a tied weight once); a tensor subclass that stores its data in
    inner tensors (QLoRA's ``NF4Tensor``: 4-bit codes, int8 scales, the scales' factors) by those inner tensors'
    storages, not the dense size its wrapper reports."""
    storages: dict[int, int] = {}
    for tensor in tensors:
        for inner in _stored(tensor):
            storages[inner.untyped_storage()._cdata] = inner.untyped_storage().nbytes()
    return sum(storages.values())


def _stored(tensor: torch.Tensor) -> list[torch.Tensor]:
    """The plain tensors that hold ``tensor``'s data: itself, or a wrapper subclass's inner tensors."""
    if type(tensor) in (torch.Tensor, nn.Parameter) or not hasattr(tensor, "__tensor_flatten__"):
        return [tensor]
    names, _ = tensor.__tensor_flatten__()
    return [plain for name in names for plain in _stored(getattr(tensor, name))]


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
    # Each trained parameter outside the repeating blocks (a tied weight once; a vision tower's blocks among them).
    root_shapes: tuple[tuple[int, ...], ...]
    block_shapes: tuple[tuple[int, ...], ...]  # each trained parameter of one repeating block
    block_input: int  # bytes of a repeating block's input, one micro-batch's hidden state
    # Bytes of one micro-batch's whole logits in float32 ([rows, seq_len, vocab]) where the step computes them (a
    # preference step at loss_chunks 1, an output projection that takes no head); 0 where the loss runs through the
    # head (the targets' logits only, ``chunked_loss.ChunkedCrossEntropy``).
    logits: int
    varlen_kv_copy: int = 0  # bytes of one block's K/V copies for varlen_attn, one micro-batch (Workload.varlen)
    # The most a step in backward held at once, unsharded (experts' temporaries scaled so that shard divides them).
    optimizer_temporaries_in_backward: float = 0
    # Under expert parallelism (``experts.simulate_expert_parallel``): the experts this process holds (E / ep of
    # each layer's), of every simulated block and of the largest one, and their optimizer state; 0 without.
    expert_parameters: int = 0
    block_expert_parameters: int = 0
    expert_optimizer: int = 0
    fixed_blocks: int = 0  # the blocks before the repeating ones, simulated whole at every depth (``repeating_blocks``)


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
        if n_blocks is not None:
            keep_blocks(model, n_blocks)  # the repeating blocks alike: a shallower model of the same blocks
        blocks = transformer_blocks(model)
        fixed, repeating = repeating_blocks(model)
        # Whole, before expert parallelism splits the experts; only what trains (a frozen base has no optimizer state).
        block_shapes = _shapes([p for p in repeating[0].parameters() if p.requires_grad])
        apply_ac_plan(model, _plan(mode, option, len(blocks)))
        ep = workload.parallelism.expert
        experts = simulate_expert_parallel(model, ep, workload.routed_rows_margin) if ep > 1 else []
        params = list(model.parameters())
        in_blocks = {id(p) for block in blocks for p in block.parameters()}
        in_repeating = {id(p) for block in repeating for p in block.parameters()}
        sharded = workload.world_size > 1 or bool(cpu_offload.shard_options(workload.settings.cpu_offload))
        tracker = _LiveStorages(workload.shard_degree, {id(p) for p in params if id(p) not in in_blocks},
                                sharded=sharded, expert_parameters=experts,
                                expert_shard_degree=workload.parallelism.expert_shard)
        if workload.compiled:
            _simulate_compiled_blocks(blocks, tracker)
        # Registered before an optimizer in backward registers its own: a gradient is seen before it is freed.
        hooks = [p.register_post_accumulate_grad_hook(tracker.mark_gradient) for p in params if p.requires_grad]
        # The run's step with the features' mechanisms, as run/assemble.py applies them (the optimizer the state's
        # feature can simulate).
        make_optimizer = optimizer_state.planner_optimizer(workload.settings.optimizer_state, make_optimizer)
        stepper = build_optimizer(make_optimizer, model, in_backward=workload.settings.optimizer_in_bwd)
        objective, reference = _objective(build_model, workload, n_blocks, model)
        optimizers = stepper.optimizers_to_checkpoint()
        _allocate_optimizer_state(optimizers)
        hooks += _phase_hooks(blocks, repeating[0], tracker)
        for opt in optimizers:
            hooks.append(opt.register_step_pre_hook(lambda *_: setattr(tracker, "in_optimizer", True)))
            hooks.append(opt.register_step_post_hook(lambda *_: setattr(tracker, "in_optimizer", False)))
        family = family_of(model)
        vocab = family.hf.architecture(family.args_of(model))["vocab_size"] if family is not None else 2
        micro_batches = []
        for _ in range(min(workload.gradient_accumulation_steps, 2)):  # gradients live across the second
            batch = _image_inputs(model, workload)
            tokens = batch.pop("tokens", None)
            tokens = torch.randint(0, vocab, (workload.rows, workload.seq_len)) if tokens is None else tokens
            # Every position a target (the loss's worst case), counted on the host as the collate code does.
            micro_batches.append({"tokens": tokens, "labels": torch.randint(0, vocab, tokens.shape),
                                  "target_count": torch.tensor(tokens.numel()), **batch})
            if workload.preference is not None and reference is None:  # precomputed: they come with the batch
                micro_batches[-1]["reference_logps"] = torch.zeros(workload.rows)
        states = [v for opt in optimizers for s in opt.state.values() for v in s.values() if isinstance(v, torch.Tensor)]
        inputs = [t for batch in micro_batches for t in batch.values() if isinstance(t, torch.Tensor)]
        frozen = [*reference.parameters(), *reference.buffers()] if reference is not None else []
        tracker.known = {t.untyped_storage()._cdata
                         for t in [*params, *states, *inputs, *model.buffers(), *frozen]}
        expert_ids = {id(p) for p in experts}
        # Their state tensors, not the step counters (one a parameter, however many experts it holds).
        expert_states = [v for opt in optimizers for p, s in opt.state.items() if id(p) in expert_ids
                         for v in s.values() if isinstance(v, torch.Tensor) and v.dim() > 0]
        tracker.expert_sources |= {t.untyped_storage()._cdata for t in expert_states}
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
            root_shapes=_shapes([p for p in params if id(p) not in in_repeating and p.requires_grad]),
            block_shapes=block_shapes,
            block_input=tracker.block_input,
            logits=workload.rows * workload.seq_len * vocab * 4 if _whole_logits(model, workload) else 0,
            varlen_kv_copy=_varlen_kv_copy(blocks[0], workload) if workload.varlen else 0,
            optimizer_temporaries_in_backward=tracker.optimizer_temporaries_in_backward,
            expert_parameters=_nbytes(experts),
            block_expert_parameters=max(_nbytes([p for p in block.parameters() if id(p) in expert_ids])
                                        for block in blocks),
            expert_optimizer=_nbytes(expert_states),
            fixed_blocks=fixed,
        )


def repeating_blocks(model: nn.Module) -> tuple[int, nn.ModuleList]:
    """The blocks the planner extrapolates over, and how many of the model's blocks come before them.

    The repeating blocks are the run of blocks of the last block's class that ends the model's blocks (a decoder's);
    blocks before them (a vision tower's, which ``transformer_blocks`` lists first) are simulated whole at every
    depth: their memory does not grow with the decoder's depth."""
    blocks = transformer_blocks(model)
    first = len(blocks) - 1
    while first > 0 and type(blocks[first - 1]) is type(blocks[-1]):
        first -= 1
    return first, nn.ModuleList(blocks[first:])


def keep_blocks(model: nn.Module, n_blocks: int) -> None:
    """Cut ``model`` to its first ``n_blocks`` blocks by dropping repeating blocks (``repeating_blocks``) from the
    module list that holds them.

    Raises:
        ValueError: ``n_blocks`` would cut into the blocks before the repeating ones.
    """
    fixed, repeating = repeating_blocks(model)
    if n_blocks <= fixed:
        raise ValueError(f"{n_blocks} blocks would cut into the {fixed} blocks before the repeating ones")
    owner = next(m for m in model.modules()
                 if isinstance(m, nn.ModuleList) and len(m) and m[-1] is repeating[-1])
    del owner[len(owner) - len(repeating) + n_blocks - fixed:]


def _image_inputs(model: nn.Module, workload: Workload) -> dict[str, Any]:
    """A micro-batch's tokens and image inputs for a step with images (``Workload.images``), as the model's family
    lays them out; empty for a text-only step.

    Raises:
        ValueError: images for a model whose family takes none.
    """
    images = workload.images
    if images is None:
        return {}
    family = family_of(model)
    if family is None or family.images is None:
        raise ValueError(f"{type(model).__name__} takes no images (Workload.images)")
    return family.images.batch(family.args_of(model), workload.rows, workload.seq_len, images.per_sample,
                               images.height, images.width)


def _whole_logits(model: nn.Module, workload: Workload) -> bool:
    """Whether the step's loss computes the whole logits (``_Simulation.logits``): a preference step in one chunk,
    or a token loss whose model takes no head (``chunked_loss.runs_target_head``); a GRPO step's never does."""
    if workload.rollouts is not None:
        return False
    if workload.preference is not None:
        return workload.settings.loss_chunks == 1
    return workload.settings.loss_chunks == 1 and not runs_target_head(model)


def _objective(build_model: Callable[[], nn.Module], workload: Workload, n_blocks: Optional[int],
               model: nn.Module) -> tuple[Any, Optional[nn.Module]]:
    """The step's objective, as the recipe builds it: the token loss (chunked as ``loss_chunks`` says), or for a
    preference step the DPO loss, with a reference model of the simulated depth when it is resident (its
    parameters, counted apart as ``MemoryEstimate.reference``, are not the step's allocations; its forward is), or
    the simulated ``model`` itself as its reference (``lora_dpo``: the base with the adapters off)."""
    chunks = workload.settings.loss_chunks
    if workload.preference is None:
        return loss_objective(chunks), None
    from torchtune_ac.training.dpo import DPOConfig, DPOObjective, freeze_reference

    if workload.preference.reference_is_policy:
        # Its parameters are the policy's (no second model): only its no_grad forward is the step's.
        return DPOObjective(DPOConfig(), n_chunks=chunks, reference=model), None
    reference = None
    if workload.preference.resident_reference:
        reference = freeze_reference(build_model())
        if n_blocks is not None:
            keep_blocks(reference, n_blocks)
        if workload.parallelism.expert > 1:
            simulate_expert_parallel(reference, workload.parallelism.expert, workload.routed_rows_margin)
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


def _phase_hooks(blocks: nn.ModuleList, repeating: nn.Module, tracker: _LiveStorages) -> list[Any]:
    """Move the tracker from phase to phase: the last block's output gradient starts the blocks' backward, the
    first block's input gradient ends it; a new forward starts with the first block's input. The first repeating
    block's input is the hidden state the features size (``block_input``)."""

    def first_input(module: nn.Module, args: tuple) -> None:
        tracker.enter("forward")
        x = args[0]
        if x.requires_grad:
            x.register_hook(lambda grad: tracker.enter("rest of backward"))

    def repeating_input(module: nn.Module, args: tuple) -> None:
        tracker.block_input = args[0].untyped_storage().nbytes()

    def last_output(module: nn.Module, args: tuple, output: Any) -> None:
        hidden = output[0] if isinstance(output, tuple) else output  # an MoE block's: its output, then its router's
        hidden.register_hook(lambda grad: tracker.enter("blocks backward"))

    return [blocks[0].register_forward_pre_hook(first_input), repeating.register_forward_pre_hook(repeating_input),
            blocks[-1].register_forward_hook(last_output)]


@torch.no_grad()
def _allocate_optimizer_state(optimizers: Sequence[torch.optim.Optimizer]) -> None:
    """Give every parameter its optimizer state, as after a first step (a step on zero gradients)."""
    for opt in optimizers:
        for group in opt.param_groups:
            for param in group["params"]:
                param.grad = torch.zeros_like(param)
        opt.step()
        opt.zero_grad(set_to_none=True)
