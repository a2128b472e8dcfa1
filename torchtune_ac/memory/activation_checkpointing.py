"""Activation checkpointing (AC): decide which transformer blocks to checkpoint, then apply it.

Three config keys decide the plan (the names are torchtune's):

    enable_activation_checkpointing: true | false
    ac_mode: none | full | selective
    ac_option: <int k> | op        # only with ac_mode: selective

``ACConfig.from_config`` checks and types the keys as they come from YAML (the config schema holds an
``ACConfig``); ``resolve_ac_plan`` (or ``ACConfig.resolve``) turns them and a layer count into an immutable
``ACPlan`` (no model needed, so ``tune validate`` can check a config before anything is built);
``apply_ac_plan`` applies a plan to a model in place. ``setup_activation_checkpointing`` does both for a
built model.

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

import dataclasses
import functools
import logging
import numbers
from dataclasses import dataclass
from enum import Enum
from typing import Any, Callable, Mapping, Optional, Union

import torch
from torch import nn
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from torchtune_ac.errors import UserError
from torchtune_ac.models.attention import VARLEN_OPS
from torchtune_ac.models.families import transformer_blocks

OP_OPTION = "op"


class ACMode(str, Enum):
    """How much of the model is checkpointed."""

    NONE = "none"
    FULL = "full"
    SELECTIVE = "selective"
    # Chosen by the memory planner: the least recompute whose estimate fits ac_memory_budget_gib.
    AUTO = "auto"


class ACConfigError(UserError):
    """One or more problems with the activation checkpointing keys; ``problems`` lists each one."""

    def __init__(self, problems: list[str]) -> None:
        self.problems = list(problems)
        if len(self.problems) == 1:
            super().__init__(self.problems[0])
        else:
            lines = "\n".join(f"  - {p}" for p in self.problems)
            super().__init__(f"{len(self.problems)} problems with the activation checkpointing settings:\n{lines}")


def _resolve_aten_ops(names: tuple[str, ...]) -> frozenset:
    """Look each ``"op.overload"`` name up on ``torch.ops.aten`` now, so a typo fails at import.

    An unknown name would otherwise make the policy silently save nothing (i.e. recompute everything).
    """
    ops = set()
    for name in names:
        packet_name, overload = name.split(".")
        ops.add(getattr(getattr(torch.ops.aten, packet_name), overload))
    return frozenset(ops)


# Ops whose outputs per-op AC keeps: every matrix multiply (nn.Linear lowers to mm on 2-D views, addmm with a
# bias, bmm in the math attention path used e.g. with attention dropout on CPU), every fused SDPA kernel
# (CPU flash, CUDA flash / memory-efficient / cuDNN; packed batches call them once per document) and
# variable-length Flash Attention (packed batches on CUDA, where torch has it: ``VARLEN_OPS``).
# ``aten.scaled_dot_product_attention`` itself is a composite op that never reaches the policy: it dispatches to
# one of these kernels or to bmm + softmax.
# Everything else (norms, rotary, SiLU, element-wise products, dropout) is cheap to recompute.
SAVED_OPS = _resolve_aten_ops(
    (
        "mm.default",
        "addmm.default",
        "bmm.default",
        "_scaled_dot_product_flash_attention_for_cpu.default",
        "_scaled_dot_product_flash_attention.default",
        "_scaled_dot_product_efficient_attention.default",
        "_scaled_dot_product_cudnn_attention.default",
    )
) | VARLEN_OPS


def save_matmuls_and_attention(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
    """Per-op AC policy: keep outputs of matrix multiplies and attention, recompute every other op.

    Args:
        ctx: the ``SelectiveCheckpointContext`` (unused: the decision is the same in forward and recompute).
        op: the ``OpOverload`` being run.

    Returns:
        ``MUST_SAVE`` for ops in ``SAVED_OPS``, else ``PREFER_RECOMPUTE``.
    """
    return CheckpointPolicy.MUST_SAVE if op in SAVED_OPS else CheckpointPolicy.PREFER_RECOMPUTE


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


def _show(value: Any) -> str:
    """Spell a config value as the user wrote it in YAML (true/false, quoted strings)."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return repr(value)
    return str(value)


def _parse_mode(ac_mode: Any, problems: list[str]) -> Optional[ACMode]:
    allowed = ", ".join(m.value for m in ACMode)
    if isinstance(ac_mode, ACMode):
        return ac_mode
    if isinstance(ac_mode, str):
        try:
            return ACMode(ac_mode.strip().lower())
        except ValueError:
            pass
    problems.append(f"ac_mode={_show(ac_mode)}: unknown mode; allowed: {allowed}")
    return None


def _allowed_k(n_layers: Optional[int]) -> str:
    bound = f"between 1 and {n_layers}" if n_layers is not None else "from 1 to the model's layer count"
    return f"an integer k {bound}"


def _parse_option(ac_option: Any, n_layers: Optional[int], problems: list[str]) -> Optional[Union[int, str]]:
    """Return k (an int in [1, n_layers]; n_layers None: unbounded) or ``"op"``; on a problem, record it and
    return None."""
    allowed = f"{_allowed_k(n_layers)} (checkpoint every k-th block) or 'op'"
    if isinstance(ac_option, bool):
        # bool is an int subclass: without this check ``true`` would silently mean k=1.
        problems.append(f"ac_option={_show(ac_option)}: a boolean is not allowed; use {allowed}")
        return None
    if isinstance(ac_option, str):
        text = ac_option.strip()
        if text.lower() == OP_OPTION:
            return OP_OPTION
        if not (text.isascii() and text.isdigit()):
            problems.append(f"ac_option={_show(ac_option)}: unknown option; use {allowed}")
            return None
        # YAML / CLI overrides may deliver a quoted number such as '2'; it means k=2.
        ac_option = int(text)
    elif not isinstance(ac_option, numbers.Integral):
        problems.append(f"ac_option={_show(ac_option)}: must be {allowed}, not {type(ac_option).__name__}")
        return None
    k = int(ac_option)
    if n_layers is None and k < 1:
        problems.append(f"ac_option={k}: must be {_allowed_k(None)}")
        return None
    if n_layers is not None and not 1 <= k <= n_layers:
        layers = "layer" if n_layers == 1 else "layers"
        problems.append(f"ac_option={k}: must be between 1 and {n_layers} (the model has {n_layers} {layers})")
        return None
    return k


def _check_keys(
    enable: Any, ac_mode: Any, ac_option: Any, n_layers: Optional[int]
) -> tuple[Optional[ACMode], Optional[Union[int, str]], list[str]]:
    """The mode and option the keys ask for, and every problem with them (k unbounded when n_layers is None)."""
    problems: list[str] = []
    if enable is not None and not isinstance(enable, bool):
        problems.append(f"enable_activation_checkpointing={_show(enable)}: must be true or false")
        enable = None

    if ac_mode is None:
        mode: Optional[ACMode] = ACMode.FULL if enable else ACMode.NONE
    else:
        mode = _parse_mode(ac_mode, problems)
    if enable is False and mode in (ACMode.FULL, ACMode.SELECTIVE, ACMode.AUTO):
        problems.append(
            f"enable_activation_checkpointing=false contradicts ac_mode={mode.value}: "
            "set enable_activation_checkpointing: true (or remove it), or set ac_mode: none"
        )
    if enable is True and mode is ACMode.AUTO:
        problems.append(
            "enable_activation_checkpointing=true contradicts ac_mode=auto, which may choose no activation "
            "checkpointing: remove enable_activation_checkpointing (on the command line: "
            "enable_activation_checkpointing=null), or set ac_mode: full or selective"
        )
    if enable is True and mode is ACMode.NONE and ac_mode is not None:
        problems.append(
            "enable_activation_checkpointing=true contradicts ac_mode=none: "
            "remove enable_activation_checkpointing, or set ac_mode: full or selective"
        )

    option: Optional[Union[int, str]] = None
    if mode in (ACMode.NONE, ACMode.FULL, ACMode.AUTO):
        if ac_option is not None:
            if ac_mode is not None:
                context = f"ac_mode is {mode.value}"
            elif enable:
                context = "enable_activation_checkpointing=true alone means full"
            else:
                context = "ac_mode is not set"
            problems.append(
                f"ac_option={_show(ac_option)}: only allowed with ac_mode: selective ({context}); "
                "remove ac_option or set ac_mode: selective"
            )
    elif ac_option is None:
        if mode is ACMode.SELECTIVE:
            problems.append(
                f"ac_mode=selective requires ac_option: {_allowed_k(n_layers)} (checkpoint every k-th block) "
                "or 'op' (per-op AC in every block)"
            )
    else:
        # The mode is selective, or unknown (already reported): still check the option's form.
        option = _parse_option(ac_option, n_layers, problems)
    return mode, option, problems


@dataclass(frozen=True)
class ACConfig:
    """The activation-checkpointing config keys, validated and typed (``ACConfig.from_config``).

    Attributes:
        enable_activation_checkpointing: the on/off switch, or None when absent.
        ac_mode: the mode, or None when absent (then the switch decides: true means full).
        ac_option: the stride k or ``"op"`` (selective only), else None.
        ac_memory_budget_gib: with ``ac_mode: auto``, the memory per process the plan must fit in (GiB); None:
            the device's free memory less a margin (CUDA only).
    """

    enable_activation_checkpointing: Optional[bool] = None
    ac_mode: Optional[ACMode] = None
    ac_option: Optional[Union[int, str]] = None
    ac_memory_budget_gib: Optional[float] = None

    @classmethod
    def from_config(cls, values: Mapping[str, Any]) -> "ACConfig":
        """Check the keys as they came from YAML (every problem that does not need the model's layer count) and
        type them: the mode as an ``ACMode``, a quoted number such as ``'2'`` as the int 2, ``op`` as ``"op"``.

        Raises:
            ACConfigError: listing every problem, each naming the key, the value and what is allowed.
        """
        enable, ac_mode, ac_option, budget = (values.get(f.name) for f in dataclasses.fields(cls))
        mode, option, problems = _check_keys(enable, ac_mode, ac_option, None)
        if budget is not None:
            if isinstance(budget, bool) or not isinstance(budget, (int, float)) or not budget > 0:
                problems.append(f"ac_memory_budget_gib={_show(budget)}: must be a positive number of GiB")
            elif mode is not ACMode.AUTO:
                problems.append(
                    f"ac_memory_budget_gib={_show(budget)}: only used by ac_mode: auto; remove it or set ac_mode: auto"
                )
        if problems:
            raise ACConfigError(problems)
        return cls(enable, None if ac_mode is None else mode, option, None if budget is None else float(budget))

    @property
    def is_auto(self) -> bool:
        return self.ac_mode is ACMode.AUTO

    def resolve(self, n_layers: int) -> ACPlan:
        """The plan for a model with ``n_layers`` blocks (see ``resolve_ac_plan``).

        Raises:
            ValueError: ``ac_mode`` is auto (the memory planner resolves it, see ``memory/plan.py``).
        """
        if self.is_auto:
            raise ValueError("ac_mode=auto is resolved by resolve_memory_plan, which estimates every plan's memory")
        return resolve_ac_plan(
            enable_activation_checkpointing=self.enable_activation_checkpointing,
            ac_mode=self.ac_mode,
            ac_option=self.ac_option,
            n_layers=n_layers,
        )


def resolve_ac_plan(
    *,
    enable_activation_checkpointing: Optional[bool],
    ac_mode: Optional[Union[str, ACMode]],
    ac_option: Optional[Union[int, str]],
    n_layers: int,
) -> ACPlan:
    """Turn the three AC config keys and the model's layer count into a plan.

    Rules: ``ac_mode``, when given, decides (matched case-insensitively). Without it,
    ``enable_activation_checkpointing: true`` means full AC (as in torchtune) and false/None means none.
    ``enable_activation_checkpointing: false`` with ``ac_mode`` full/selective, or ``true`` with ``ac_mode:
    none``, is a contradiction and is rejected. ``ac_mode: selective`` requires ``ac_option``: an int k
    checkpoints block i when ``(i + 1) % k == 0`` (k=2 on 8 blocks: 1, 3, 5, 7), with
    ``1 <= k <= n_layers``; a string of digits such as ``'2'`` (a quoted YAML number) is accepted as k;
    ``'op'`` applies per-op AC to every block (see ``save_matmuls_and_attention``). ``ac_option`` with any
    other mode is rejected, as are booleans (``true`` is not 1) and floats.

    Args:
        enable_activation_checkpointing: the legacy on/off switch, or None when absent.
        ac_mode: ``none``, ``full`` or ``selective`` (or an ``ACMode``), or None when absent.
        ac_option: the stride k or ``"op"`` for selective AC, else None.
        n_layers: number of transformer blocks in the model that will be built.

    Returns:
        The resolved ``ACPlan``.

    Raises:
        ACConfigError: listing every problem found, each naming the key, the value and what is allowed.
        ValueError: if ``n_layers`` is not a positive int (a caller bug, not a config mistake).
    """
    if isinstance(n_layers, bool) or not isinstance(n_layers, int) or n_layers < 1:
        raise ValueError(f"n_layers must be a positive int, got {n_layers!r}")
    mode, option, problems = _check_keys(enable_activation_checkpointing, ac_mode, ac_option, n_layers)
    if mode is ACMode.AUTO and not problems:
        problems.append(
            "ac_mode=auto: chosen by the memory planner from ac_memory_budget_gib when a run starts (see tune plan); "
            "here use none, full or selective"
        )
    if problems:
        raise ACConfigError(problems)

    if mode is ACMode.NONE:
        return ACPlan(mode, None, (), n_layers)
    if mode is ACMode.FULL:
        return ACPlan(mode, None, tuple(range(n_layers)), n_layers)
    if option == OP_OPTION:
        return ACPlan(mode, OP_OPTION, tuple(range(n_layers)), n_layers, policy=save_matmuls_and_attention)
    blocks = tuple(i for i in range(n_layers) if (i + 1) % option == 0)
    return ACPlan(mode, option, blocks, n_layers)


class CheckpointedForward:
    """Stands in for a block's ``forward``: runs the original under non-reentrant activation checkpointing.

    Set as an instance attribute (``block.forward = CheckpointedForward(block.forward, ...)``), so the block's
    class, parameters, hooks and state_dict keys are untouched.
    """

    def __init__(self, forward: Callable[..., Any], policy: Optional[Callable[..., CheckpointPolicy]]) -> None:
        self.original_forward = forward
        # Only per-op AC passes a context_fn: torch.compile traces checkpoint() with or without one, but not
        # with an explicit no-op one.
        self.extra = {} if policy is None else {"context_fn": functools.partial(create_selective_checkpoint_contexts, policy)}

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
        plan: a plan from ``resolve_ac_plan`` for ``len(model.layers)`` layers.

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
        layers[i].forward = CheckpointedForward(layers[i].forward, plan.policy)


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


def setup_activation_checkpointing(
    model: nn.Module,
    *,
    enable_activation_checkpointing: Optional[bool] = None,
    ac_mode: Optional[Union[str, ACMode]] = None,
    ac_option: Optional[Union[int, str]] = None,
) -> ACPlan:
    """Resolve the AC keys against ``len(model.layers)`` and apply the plan to ``model`` in place.

    See ``resolve_ac_plan`` for the rules and ``apply_ac_plan`` for how AC is applied.

    Args:
        model: a model with a ``layers`` ``nn.ModuleList`` of transformer blocks.
        enable_activation_checkpointing: the legacy on/off switch (None when absent).
        ac_mode: ``none``, ``full`` or ``selective`` (None when absent).
        ac_option: the stride k or ``"op"`` for selective AC (None when absent).

    Returns:
        The plan that was applied (``str(plan)`` is a one-line summary for logs).

    Raises:
        ACConfigError: if the keys are invalid or contradictory (lists every problem).
        UserError: if the model has no non-empty ``layers`` ``nn.ModuleList``.
        RuntimeError: if AC was already applied to this model.
    """
    plan = resolve_ac_plan(
        enable_activation_checkpointing=enable_activation_checkpointing,
        ac_mode=ac_mode,
        ac_option=ac_option,
        n_layers=len(transformer_blocks(model)),
    )
    apply_ac_plan(model, plan)
    return plan
