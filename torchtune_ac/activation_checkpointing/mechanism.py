"""Activation checkpointing (AC), the mechanism: a plan of which transformer blocks recompute their activations in
backward, and the function that applies it to a model. It knows nothing of config keys: the keys
(``enable_activation_checkpointing``, ``ac_mode``, ``ac_option``) and how they resolve to a plan are
``config.py``'s; ``ac_mode: auto``'s choice is the memory planner's (``memory/plan.py``).

``ACPlan`` is a frozen value (printed by ``tune validate``, compared by the planner); ``apply_ac_plan`` applies
one to a model in place, once, before compile and sharding.

How AC is applied: each chosen block's ``forward`` is routed through a non-reentrant
``torch.utils.checkpoint.checkpoint`` of the original ``forward``. No module is swapped or wrapped, so
``model.state_dict()`` keys do not change, checkpoints load whatever the AC setting, and ``fully_shard`` is
applied to the very same blocks afterwards. RNG state is restored before recomputing, so dropout masks are
replayed exactly: gradients are bit-identical to no AC.

Why not the hook-based ``torch.distributed._composable.checkpoint``: its hooks run outside a compiled
block (``block.compile()``), where per-op AC silently degrades to full recompute (the policy sees the
compiled kernels' ``aten.mm.out`` calls, not the matrix multiplies it keeps). A checkpoint call inside
``forward`` is traced by ``torch.compile`` together with its policy, so every mode works compiled too.
"""

from __future__ import annotations

import functools
import logging
from collections import defaultdict
from dataclasses import dataclass
from enum import Enum
from typing import Any, Callable, Optional, Union

import torch
from torch import nn
from torch.utils.checkpoint import (
    CheckpointPolicy,
    _CachedTorchDispatchMode,
    _CachingTorchDispatchMode,
    checkpoint,
)

from torchtune_ac.models.attention import VARLEN_OPS
from torchtune_ac.models.families import transformer_blocks
from torchtune_ac.models.moe import MoE

OP_OPTION = "op"


class ACMode(str, Enum):
    """How much of the model is checkpointed."""

    NONE = "none"
    FULL = "full"
    SELECTIVE = "selective"
    # Chosen by the memory planner: the least recompute whose estimate fits ac_memory_budget_gib.
    AUTO = "auto"


def _resolve_aten_ops(names: tuple[str, ...], namespace: str = "aten") -> frozenset:
    """Look each ``"op.overload"`` name up on ``torch.ops.<namespace>`` now, so a typo fails at import.

    An unknown name would otherwise make the policy silently save nothing (i.e. recompute everything).
    """
    ops = set()
    for name in names:
        packet_name, overload = name.split(".")
        ops.add(getattr(getattr(getattr(torch.ops, namespace), packet_name), overload))
    return frozenset(ops)


# Ops whose outputs per-op AC keeps: every matrix multiply (nn.Linear lowers to mm on 2-D views, addmm with a
# bias, bmm in the math attention path used e.g. with attention dropout on CPU), every fused SDPA kernel
# (CPU flash, CUDA flash / memory-efficient / cuDNN; packed batches call them once per document) and
# variable-length Flash Attention (packed batches on CUDA, where torch has it: ``VARLEN_OPS``).
# ``aten.scaled_dot_product_attention`` itself is a composite op that never reaches the policy: it dispatches to
# one of these kernels or to bmm + softmax.
# Tensor parallelism's collectives (DTensor issues them as functional collectives, each result then waited for):
# the all-gathers before each block's column-split projections, the reduce-scatters after its row-split ones, and
# all-reduces. Recomputing them would send the block's traffic again in backward; their outputs are activations of
# the block's size divided among the group, like the matmuls' own.
# A mixture of experts' grouped matmul (every expert of a layer in one call; in float32 through our op of torch's
# kernel, ``models/moe.py``) is a matmul too; expert parallelism's
# all-to-alls (the tokens to their experts' processes and back, and the counts that size them) are collectives of
# the routed rows: saved, a recomputed block does not send its tokens again.
# Everything else (norms, rotary, SiLU, element-wise products, dropout) is cheap to recompute.
# The collectives a block may run as functional collectives, each result then waited for.
COLLECTIVE_OPS = (
    _resolve_aten_ops(
        ("all_gather_into_tensor.default", "reduce_scatter_tensor.default", "all_reduce.default",
         "all_to_all_single.default", "wait_tensor.default"),
        namespace="_c10d_functional",
    )
    if torch.distributed.is_available()
    else frozenset()
)
# Expert parallelism's rows exchange (``parallel/expert_parallel.py``'s ``all_to_all_rows``, our op, which reads its
# splits inside so that a compiled block holds no host read), known by name: AC does not import the parallel room.
ROWS_EXCHANGE_OP = "torchtune_ac::all_to_all_rows"


def _is_collective(op: Any) -> bool:
    return op in COLLECTIVE_OPS or (isinstance(op, torch._ops.OpOverload) and op.name() == ROWS_EXCHANGE_OP)


SAVED_OPS = _resolve_aten_ops(
    (
        "mm.default",
        "addmm.default",
        "bmm.default",
        "_grouped_mm.default",
        "_scaled_dot_product_flash_attention_for_cpu.default",
        "_scaled_dot_product_flash_attention.default",
        "_scaled_dot_product_efficient_attention.default",
        "_scaled_dot_product_cudnn_attention.default",
    )
) | VARLEN_OPS | _resolve_aten_ops(("grouped_mm.default",), namespace="torchtune_ac") | COLLECTIVE_OPS


# Per-op AC replays a block's ops by counting each op's calls in forward and in the recompute, and refuses a call
# it did not count in forward. FSDP2's profiler annotations are no tensor computation, yet their number differs
# between the two when an FSDP2 group sits inside a checkpointed block (expert parallelism's experts: the recompute,
# run in backward, enters "FSDP::root_pre_forward" as well; pytorch/pytorch#185178, torchtitan#3427). torch's
# checkpoint leaves a few such ops out of its count (its global ``SAC_IGNORED_OPS``); our regions leave these out
# too, in their own dispatch modes (``_selective_contexts``), so other checkpointed regions of the process keep
# torch's count.
PROFILER_OPS = frozenset({
    torch.ops.profiler._record_function_enter_new.default,
    torch.ops.profiler._record_function_exit._RecordFunction,
})


class _IgnoringProfilerOps:
    """Runs ``PROFILER_OPS`` uncounted and unsaved, as torch runs its own ``SAC_IGNORED_OPS``; anything else as the
    per-op AC mode it is mixed into."""

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: Optional[dict] = None) -> Any:
        if func in PROFILER_OPS:
            return func(*args, **(kwargs or {}))
        return super().__torch_dispatch__(func, types, args, kwargs)


class _Caching(_IgnoringProfilerOps, _CachingTorchDispatchMode):
    """Per-op AC's forward mode (runs the policy, stores what it saves), profiler annotations uncounted."""


class _Cached(_IgnoringProfilerOps, _CachedTorchDispatchMode):
    """Per-op AC's recompute mode (hands back what forward stored), profiler annotations uncounted."""


def _selective_contexts(policy: Callable[..., CheckpointPolicy]) -> tuple[_Caching, _Cached]:
    """The two modes of a per-op checkpointed region (``create_selective_checkpoint_contexts(policy)``'s, sharing
    one storage), each leaving ``PROFILER_OPS`` out of its count."""
    storage: dict[Any, dict[int, Any]] = defaultdict(dict)
    return _Caching(policy, storage), _Cached(policy, storage)


# A matrix multiply whose output is at least this many times wider than its inner dimension (a low-rank adapter's
# B (A x): r in, a whole [b, s, out] out) costs 2 r flops an output element to recompute: recomputed, not kept (its
# rank-sized input A x is). A model's own linears widen by a few times at most (an MLP's up projection).
WIDENING = 16
_MM, _ADDMM = torch.ops.aten.mm.default, torch.ops.aten.addmm.default


def _widens(op: Any, args: tuple) -> bool:
    """Whether ``op`` on ``args`` is a matrix multiply that widens its input ``WIDENING`` times or more."""
    operands = args[:2] if op is _MM else args[1:3] if op is _ADDMM else ()
    if len(operands) < 2:
        return False
    a, b = operands
    return a.shape[-1] * WIDENING <= b.shape[-1]


def save_matmuls_and_attention(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
    """Per-op AC policy: keep outputs of matrix multiplies (but a widening one's: ``WIDENING``), attention and
    collectives, recompute every other op.

    Args:
        ctx: the ``SelectiveCheckpointContext`` (unused: the decision is the same in forward and recompute).
        op: the ``OpOverload`` being run.

    Returns:
        ``MUST_SAVE`` for ops in ``SAVED_OPS``, else ``PREFER_RECOMPUTE``.
    """
    return (CheckpointPolicy.MUST_SAVE if (op in SAVED_OPS or _is_collective(op)) and not _widens(op, args)
            else CheckpointPolicy.PREFER_RECOMPUTE)


def save_collectives(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
    """Full AC's policy in a mixture-of-experts block: keep the collectives' and the random ops' outputs, recompute
    every other op. Under expert parallelism the collectives are the all-to-alls that send the block's tokens to
    their experts and back (and the counts that size them): the recompute computes everything again but sends
    nothing again, so backward's traffic is the gradients' alone. (Tensor parallelism, whose collectives are the
    others, does not run with experts.)

    The random ops are the attention kernels (torch tags them so for their dropout) and dropout, one activation of
    the block's size each: kept, nothing random is replayed; but an in-place one (``bernoulli_``, dropout's mask on
    the math path), whose output the ops after it mutate: that one is replayed from its saved RNG state. Compiled, that is what lets the block compile under
    expert parallelism: torch 2.13's partitioner puts a replayed random op's saved RNG state after the experts'
    DTensor mesh among the values saved for backward, where it expects the mesh last, and fails."""
    if _is_collective(op) or (isinstance(op, torch._ops.OpOverload) and torch.Tag.nondeterministic_seeded in op.tags
                              and not op._schema.is_mutable):
        return CheckpointPolicy.MUST_SAVE
    return CheckpointPolicy.PREFER_RECOMPUTE


@dataclass(frozen=True)
class ACPlan:
    """What to checkpoint, resolved from the config keys and the model's layer count.

    Attributes:
        mode: none, full or selective.
        option: the stride ``k`` or ``"op"`` for selective, else None.
        checkpointed_blocks: 0-based indices of the blocks that get AC, ascending.
        n_layers: number of transformer blocks the plan was resolved for.
        policy: per-op policy for ``create_selective_checkpoint_contexts`` (per-op AC), or None to
            recompute the whole block.
    """

    mode: ACMode
    option: Optional[Union[int, str]]
    checkpointed_blocks: tuple[int, ...]
    n_layers: int
    policy: Optional[Callable[..., CheckpointPolicy]] = None

    def __str__(self) -> str:
        if self.mode is ACMode.NONE:
            return "none"
        all_blocks = f"all {self.n_layers} block{'s' if self.n_layers != 1 else ''}"
        if self.mode is ACMode.FULL:
            return f"full: {all_blocks}"
        if self.option == OP_OPTION:
            return f"selective per-op (save matmuls and attention, recompute the rest): {all_blocks}"
        return (
            f"selective every {_ordinal(self.option)} block: {len(self.checkpointed_blocks)} of {self.n_layers} "
            f"blocks {list(self.checkpointed_blocks)}"
        )


def _ordinal(n: int) -> str:
    suffix = "th" if 10 <= n % 100 <= 20 else {1: "st", 2: "nd", 3: "rd"}.get(n % 10, "th")
    return f"{n}{suffix}"


def ac_plan(mode: ACMode, option: Optional[Union[int, str]], n_layers: int) -> ACPlan:
    """The plan of an already valid mode and option for ``n_layers`` blocks: none, full, per-op (``option`` is
    ``"op"``) or every k-th block (``option`` is k: block i when ``(i + 1) % k == 0``)."""
    if mode is ACMode.NONE:
        return ACPlan(mode, None, (), n_layers)
    if mode is ACMode.FULL:
        return ACPlan(mode, None, tuple(range(n_layers)), n_layers)
    if option == OP_OPTION:
        return ACPlan(mode, OP_OPTION, tuple(range(n_layers)), n_layers, policy=save_matmuls_and_attention)
    return ACPlan(mode, option, tuple(i for i in range(n_layers) if (i + 1) % option == 0), n_layers)


class CheckpointedForward:
    """Stands in for a block's ``forward``: runs the original under non-reentrant activation checkpointing.

    Set as an instance attribute (``block.forward = CheckpointedForward(block.forward, ...)``), so the block's
    class, parameters, hooks and state_dict keys are untouched.
    """

    def __init__(self, forward: Callable[..., Any], policy: Optional[Callable[..., CheckpointPolicy]]) -> None:
        self.original_forward = forward
        # Only per-op AC passes a context_fn: torch.compile traces checkpoint() with or without one, but not
        # with an explicit no-op one.
        self.extra = {} if policy is None else {"context_fn": functools.partial(_selective_contexts, policy)}

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return checkpoint(self.original_forward, *args, use_reentrant=False, **self.extra, **kwargs)


def is_checkpointed(module: nn.Module) -> bool:
    """Whether activation checkpointing has been applied to ``module`` by ``apply_ac_plan``."""
    return isinstance(module.__dict__.get("forward"), CheckpointedForward)


def apply_ac_plan(model: nn.Module, plan: ACPlan) -> None:
    """Apply a plan to ``model.layers`` in place, without changing module structure or state_dict keys.

    Call it once, on the unsharded model (before ``fully_shard`` and before ``block.compile()``).

    Args:
        model: a model with a ``layers`` ``nn.ModuleList`` of transformer blocks.
        plan: a plan for ``len(model.layers)`` layers (``ac_plan``, or ``ac_config.resolve_ac_plan`` from the keys).

    Raises:
        UserError: if the model has no non-empty ``layers`` ``nn.ModuleList``.
        ValueError: if ``plan.n_layers != len(model.layers)``.
        RuntimeError: if any block already has activation checkpointing (applying twice is a bug;
            nothing is changed).
    """
    layers = transformer_blocks(model)
    if plan.n_layers != len(layers):
        raise ValueError(
            f"the AC plan was resolved for {plan.n_layers} layers but the model has {len(layers)}; "
            "resolve it with n_layers=len(model.layers)"
        )
    already = [i for i, block in enumerate(layers) if is_checkpointed(block)]
    if already:
        raise RuntimeError(
            f"activation checkpointing is already applied to blocks {already} of this model; "
            "apply an AC plan once per model"
        )
    for i in plan.checkpointed_blocks:
        policy = plan.policy
        if policy is None and plan.mode is ACMode.FULL and any(isinstance(m, MoE) for m in layers[i].modules()):
            policy = save_collectives  # an expert-parallel exchange is not sent again (``save_collectives``)
        layers[i].forward = CheckpointedForward(layers[i].forward, policy)


_COMPILED_POLICY_WARNING = "context_fn is passed to torch.utils.checkpoint under torch.compile"


class _DropCompiledPolicyWarning(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return _COMPILED_POLICY_WARNING not in record.getMessage()


def silence_compiled_policy_warning() -> None:
    """Drop torch's one-time "make sure the checkpointed region does not contain in-place ops" warning.

    ``torch.compile`` prints it whenever a checkpoint with a policy (per-op AC) is traced, because an in-place
    write inside the region could overwrite a tensor the policy saved. Call this only for blocks known not to
    do that: the built-in ``TransformerBlock`` never writes to its inputs or to a matmul/attention output
    (``test_transformer_block_mutates_nothing_per_op_ac_saves``), and compiled per-op AC is checked against
    eager. Custom models keep the warning. Idempotent.
    """
    logger = logging.getLogger("torch._higher_order_ops.wrap")
    if not any(isinstance(f, _DropCompiledPolicyWarning) for f in logger.filters):
        logger.addFilter(_DropCompiledPolicyWarning())
