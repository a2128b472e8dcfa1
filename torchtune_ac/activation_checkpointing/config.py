"""The activation-checkpointing config keys (torchtune's names) and the plan they resolve to for a model.

    enable_activation_checkpointing: true | false
    ac_mode: none | full | selective | auto
    ac_option: <int k> | op        # only with ac_mode: selective
    ac_memory_budget_gib: <GiB>    # only with ac_mode: auto

``ACConfig.from_config`` checks and types the keys as they come from YAML (the schema holds an ``ACConfig``, which
validates itself); ``resolve_ac_plan`` (or ``ACConfig.resolve``) turns them and a layer count into an ``ACPlan``
(no model needed, so ``tune validate`` can check a config before anything is built);
``setup_activation_checkpointing`` resolves them for a built model and applies the plan
(``mechanism.apply_ac_plan``, which knows nothing of keys). ``ac_mode: auto`` is
chosen by the memory planner (``memory/plan.py``), from every plan's estimate.

The grammar is torchtune's, kept because these keys are the contract a torchtune user's configs and command lines
carry over with: ``enable_activation_checkpointing: true`` alone means full AC; ``ac_mode``, when given, decides; a
combination torchtune would silently reinterpret is refused, every problem named at once.
"""

from __future__ import annotations

import dataclasses
import numbers
from dataclasses import dataclass
from typing import Any, Mapping, Optional, Union

from torch import nn

from torchtune_ac.config_key import config_key
from torchtune_ac.errors import UserError
from torchtune_ac.models.families import transformer_blocks
from torchtune_ac.activation_checkpointing.mechanism import OP_OPTION, ACMode, ACPlan, ac_plan, apply_ac_plan


class ACConfigError(UserError):
    """One or more problems with the activation checkpointing keys; ``problems`` lists each one."""

    def __init__(self, problems: list[str]) -> None:
        self.problems = list(problems)
        if len(self.problems) == 1:
            super().__init__(self.problems[0])
        else:
            lines = "\n".join(f"  - {p}" for p in self.problems)
            super().__init__(f"{len(self.problems)} problems with the activation checkpointing settings:\n{lines}")


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
    """The activation-checkpointing config keys (top-level keys of the YAML), validated and typed by
    ``from_config``: the mode as an ``ACMode``, ``ac_option`` as k or ``"op"``."""

    enable_activation_checkpointing: Optional[bool] = config_key(
        None, doc="Checkpoint every transformer block (true), or none (false); torchtune's switch. Without ac_mode, "
        "true means full AC; with ac_mode, it must agree with it or be left out.")
    ac_mode: Optional[ACMode] = config_key(
        None, doc="none, full (every block), selective (every ac_option-th block, or per-op AC with ac_option: op), "
        "or auto: the least recompute whose estimated memory fits ac_memory_budget_gib (chosen when the run starts; "
        "see tune plan). null: enable_activation_checkpointing decides.")
    ac_option: Optional[Union[int, str]] = config_key(
        None, doc="With ac_mode: selective, an integer k (checkpoint every k-th block, 1 to the model's layer count) "
        "or op (in every block, save matmul and attention outputs and recompute the rest).")
    ac_memory_budget_gib: Optional[float] = config_key(
        None, doc="With ac_mode: auto, the memory per process the chosen plan must fit in, in GiB; null: on CUDA, "
        "the device's free memory when the run starts, less 10 % of the device (on a CPU it must be set).")

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
    ``'op'`` applies per-op AC to every block (see ``activation_checkpointing.save_matmuls_and_attention``). ``ac_option`` with any
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

    return ac_plan(mode, option, n_layers)


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
