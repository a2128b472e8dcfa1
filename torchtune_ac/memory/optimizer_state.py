"""The optimizer's state layout: how many bytes each parameter's optimizer state takes, by the optimizer the
config names (``optimizer._component_``), without importing or building it.

torchao's low-bit AdamW keep each moment quantized in blocks (Dettmers et al., 2021; Li et al., 2023):

- ``torchao.optim.AdamW8bit``: 1 byte per element and one fp32 scale per block of 256 (a 256-entry fp32 lookup
  table per tensor): 2.03 bytes per parameter for the two moments, 0.25x fp32 AdamW's 8;
- ``torchao.optim.AdamW4bit``: half a byte per element and an fp32 scale per block of 128 (16-entry table):
  1.06 bytes per parameter, 0.13x;
- ``torchao.optim._AdamW(bf16_stochastic_round=True)``: the moments in the parameters' dtype, as
  ``torch.optim.AdamW``, but the weights rounded stochastically to bf16 (an update smaller than bf16's precision
  then still moves the weight on average).

A tensor is quantized only when its local shard (under FSDP2, a rank's rows) has at least ``MIN_QUANTIZED``
elements and a multiple of the block size (torchao's rule, after bitsandbytes); others keep full moments in the
parameters' dtype. ``state_bytes`` counts by that rule from the parameters' shapes, which is what the planner
uses: torchao's step is a ``torch.compile``-d kernel per parameter that cannot run under fake tensors, and
compiled, its arithmetic is fused, so beside the state it allocates nothing worth counting.

Each distinct parameter shape's first step compiles that kernel (tens of seconds on a CPU, once per process):
``announce_first_step`` logs a line before it, so a run's first step is not silent.

As a memory feature (``FEATURE``) it has no key of its own: the layout comes from ``optimizer._component_`` and its
arguments. ``tune validate`` prints it with the memory plan; ``tune plan`` and ``ac_mode: auto`` count the state by
it (the planner simulates ``planner_optimizer``'s stand-in for torchao's compiled step, and adds the state from the
parameters' shapes); when nothing fits, fp32 or bf16 AdamW suggests torchao's 8-bit AdamW.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Mapping, Optional, Sequence

import torch
from torch import nn

from torchtune_ac.errors import UserError
from torchtune_ac.memory.feature import Alternative, Feature, FeatureCost, MakeOptimizer, ModelSizes, ResolveInputs

log = logging.getLogger("torchtune_ac.memory")

# torchao quantizes a tensor of at least this many elements (and a multiple of the block size).
MIN_QUANTIZED = 4096
FP32_ADAMW_BYTES = 8  # two fp32 moments per parameter: the reference of the ratios printed


@dataclass(frozen=True)
class StateLayout:
    """How an optimizer keeps its state.

    Attributes:
        optimizer: the ``_component_`` path.
        states: state tensors per parameter (AdamW's two moments; three with ``amsgrad``).
        bits: 8 or 4 for a quantized state, None for the parameters' dtype.
        block_size: elements sharing one fp32 scale (quantized only).
        table: entries of the fp32 lookup table of each quantized tensor.
        compiled: the first step compiles the update (torchao).
        counted: the planner counts the state from this layout (True), or simulates the optimizer itself (a
            ``torch.optim`` class: its state is then exactly what it allocates).
        stochastic_rounding: bf16 weights are rounded stochastically after each update.
    """

    optimizer: str
    states: int
    bits: Optional[int] = None
    block_size: int = 0
    table: int = 0
    compiled: bool = False
    counted: bool = False
    stochastic_rounding: bool = False

    def name(self, dtype: torch.dtype) -> str:
        """``8-bit``, ``4-bit``, or the parameters' dtype (``fp32``, ``bf16``)."""
        if self.bits is not None:
            return f"{self.bits}-bit"
        return {torch.float32: "fp32", torch.bfloat16: "bf16"}.get(dtype, str(dtype).removeprefix("torch."))


# torch.optim classes whose state is a number of tensors like the parameter (their planner count is simulated).
_TORCH_STATES: dict[str, Callable[[Mapping[str, Any]], int]] = {
    "torch.optim.AdamW": lambda kwargs: 3 if kwargs.get("amsgrad") else 2,
    "torch.optim.Adam": lambda kwargs: 3 if kwargs.get("amsgrad") else 2,
    "torch.optim.SGD": lambda kwargs: 1 if kwargs.get("momentum", 0) else 0,
}
# torchao optimizer -> (bits, default block size, lookup-table entries); _AdamW's moments are unquantized.
_TORCHAO = {
    "torchao.optim.AdamW8bit": (8, 256, 256),
    "torchao.optim.AdamW4bit": (4, 128, 16),
    "torchao.optim._AdamW": (None, 0, 0),
}
EIGHT_BIT = "torchao.optim.AdamW8bit"


def layout_of(path: str, kwargs: Mapping[str, Any]) -> Optional[StateLayout]:
    """The state layout of the optimizer ``path`` built with ``kwargs``; None when not known here (a ``torch.optim``
    class outside ``_TORCH_STATES``, or another package's optimizer allowed by the user): the planner then
    simulates it."""
    if path in _TORCH_STATES:
        return StateLayout(path, _TORCH_STATES[path](kwargs))
    if path in _TORCHAO:
        bits, block_size, table = _TORCHAO[path]
        return StateLayout(path, 3 if kwargs.get("amsgrad") else 2, bits, int(kwargs.get("block_size", block_size)),
                           table, compiled=True, counted=True,
                           stochastic_rounding=bool(kwargs.get("bf16_stochastic_round", False)))
    return None


def _local_numel(shape: Sequence[int], world_size: int) -> int:
    """Elements of rank 0's shard (the largest) of a parameter FSDP2 shards on dim 0 over ``world_size`` ranks."""
    if not shape:
        return 1
    rows = math.ceil(shape[0] / world_size)
    return min(rows, shape[0]) * math.prod(shape[1:])


def state_bytes(layout: StateLayout, shapes: Iterable[Sequence[int]], dtype: torch.dtype, world_size: int = 1) -> int:
    """Bytes of the optimizer state of the parameters of ``shapes`` on rank 0 of ``world_size`` (1: the whole
    model), by ``layout``: quantized tensors as codes, scales and table, others in ``dtype``. The step counters
    (a scalar each) are left out."""
    total = 0
    for shape in shapes:
        numel = _local_numel(shape, world_size)
        quantized = layout.bits is not None and numel >= MIN_QUANTIZED and numel % layout.block_size == 0
        if quantized:
            per_tensor = numel * layout.bits // 8 + 4 * (numel // layout.block_size) + 4 * layout.table
        else:
            per_tensor = numel * dtype.itemsize
        total += layout.states * per_tensor
    return total


def describe_layout(layout: Optional[StateLayout], path: str, dtype: torch.dtype,
                    bytes_per_parameter: Optional[float]) -> str:
    """The ``optimizer state`` line of ``tune validate`` and the run's log."""
    if layout is None:
        return f"{path}: as its first step allocates it (the planner simulates it)"
    plain = StateLayout(path, layout.states).name(dtype)
    if layout.bits is not None:
        detail = (f"{layout.states} states in {layout.bits} bits with an fp32 scale per {layout.block_size} elements; "
                  f"tensors under {MIN_QUANTIZED:,} elements in {plain}")
    else:
        detail = f"{layout.states} states in {plain}"
    if layout.stochastic_rounding:
        detail += "; bf16 weights rounded stochastically"
    text = f"{layout.name(dtype)} ({path}: {detail})"
    if bytes_per_parameter is not None:
        text += (f": {bytes_per_parameter:.2f} bytes per parameter, {bytes_per_parameter / FP32_ADAMW_BYTES:.2f}x "
                 f"fp32 AdamW's {FP32_ADAMW_BYTES}")
    if layout.compiled:
        text += "; its first step compiles (tens of seconds on a CPU)"
    return text


class _FirstStepNotice:
    """A step pre-hook for every optimizer a factory builds: logs one line at the first step of any of them (the
    one that compiles), then removes itself from all."""

    def __init__(self, message: str) -> None:
        self.message = message
        self.handles: list[Any] = []

    def __call__(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        log.info(self.message)
        for handle in self.handles:
            handle.remove()
        self.handles = []


def announce_first_step(make_optimizer: Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer],
                        message: str) -> Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer]:
    """``make_optimizer``, with ``message`` logged once before the first step of any optimizer it builds (the
    per-parameter optimizers of a step in backward share it)."""
    notice = _FirstStepNotice(message)

    def build(params: Iterable[nn.Parameter]) -> torch.optim.Optimizer:
        optimizer = make_optimizer(params)
        notice.handles.append(optimizer.register_step_pre_hook(notice))
        return optimizer

    return build


def stand_in_optimizer(params: Iterable[nn.Parameter]) -> torch.optim.Optimizer:
    """What the planner simulates in place of an optimizer whose state it counts from the layout: an in-place step
    that keeps no state and allocates nothing (as torchao's compiled step, its state aside)."""
    return torch.optim.SGD(params, lr=0.0)


# ----------------------------------------------------------------------------------------------------- the feature


@dataclass(frozen=True)
class OptimizerState:
    """The feature's setting: the optimizer's state layout (None: not known here, simulated), its ``_component_``
    path, the parameters' dtype (that of the unquantized states), and the bytes per parameter it comes to for the
    run's model (None where no model was sized: a suggestion)."""

    layout: Optional[StateLayout]
    path: str = ""
    dtype: torch.dtype = torch.float32
    bytes_per_parameter: Optional[float] = None


def optimizer_factory(setting: OptimizerState, make_optimizer: MakeOptimizer) -> MakeOptimizer:
    """The factory the run builds its optimizers with: ``make_optimizer``, announcing a compiling first step."""
    if setting.layout is None or not setting.layout.compiled:
        return make_optimizer
    return announce_first_step(make_optimizer, f"{setting.path}: compiling its update for each parameter shape (tens "
                                               "of seconds on a CPU, once per process) before the first step")


def planner_optimizer(setting: OptimizerState, make_optimizer: MakeOptimizer) -> MakeOptimizer:
    """The optimizer the planner simulates: the config's, or ``stand_in_optimizer`` where the state is counted from
    the layout (torchao's compiled step cannot run under fake tensors)."""
    counted = setting.layout is not None and setting.layout.counted
    return stand_in_optimizer if counted else make_optimizer


def _resolve(inputs: ResolveInputs) -> OptimizerState:
    if inputs.optimizer is None:
        return OFF
    layout = layout_of(inputs.optimizer.path, inputs.optimizer.kwargs)
    if layout is not None and layout.stochastic_rounding and inputs.dtype.itemsize != 2:
        raise UserError(
            f"optimizer.bf16_stochastic_round=true with dtype={layout.name(inputs.dtype)}: stochastic rounding "
            "applies to bf16 weights only; set dtype: bf16, or drop optimizer.bf16_stochastic_round"
        )
    per_parameter = None
    if layout is not None:
        shapes = [tuple(p.shape) for p in {id(p): p for p in inputs.model.parameters()}.values() if p.requires_grad]
        per_parameter = state_bytes(layout, shapes, inputs.dtype) / max(1, sum(math.prod(s) for s in shapes))
    return OptimizerState(layout, inputs.optimizer.path, inputs.dtype, per_parameter)


def _describe(setting: OptimizerState, vocab_size: Optional[int]) -> str:
    if not setting.path:
        return "as the optimizer allocates it"
    return describe_layout(setting.layout, setting.path, setting.dtype, setting.bytes_per_parameter)


def _planner_cost(setting: OptimizerState, sizes: ModelSizes) -> FeatureCost:
    if setting.layout is None or not setting.layout.counted:
        return FeatureCost()
    counted = state_bytes(setting.layout, sizes.shapes, sizes.dtype, sizes.world_size)
    return FeatureCost(device={"optimizer": counted - sizes.so_far.get("optimizer", 0)})


def _alternatives(setting: OptimizerState) -> list[Alternative]:
    if setting.layout is None or setting.layout.bits is not None or setting.layout.states != 2:
        return []
    return [Alternative(f"optimizer._component_={EIGHT_BIT} (the ao extra)",
                        OptimizerState(layout_of(EIGHT_BIT, {}), EIGHT_BIT))]


def _resume_record(setting: OptimizerState) -> dict:
    # Recorded only for a quantized state, so runs from before the feature existed still resume.
    if setting.layout is None or setting.layout.bits is None:
        return {}
    return {"optimizer_state": setting.layout.name(setting.dtype)}


OFF = OptimizerState(None)
FEATURE = Feature(name="optimizer_state", label="optimizer state", off=OFF, resolve=_resolve, describe=_describe,
                  planner_cost=_planner_cost, alternatives=_alternatives, resume_record=_resume_record)
