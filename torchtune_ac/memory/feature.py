"""What the memory plan, ``tune validate`` and the memory planner ask of a memory feature: plain functions of its
setting, declared in a ``Feature`` by the feature's own module, beside its mechanism.

A feature (activation checkpointing, the optimizer state's precision, the optimizer step in backward, the chunked
loss, activation offloading, CPU offload) is listed once, in ``features.py``. Its keys are written in the schema's
groups (``MemoryConfig``, here, below the plan that lists the features; ``FSDPConfig``; ``ACConfig``);
``resolve`` turns them into its *setting*, a plain value the ``MemoryPlan`` holds under the feature's name.

What a feature does to the run is not a hook here: the run applies each mechanism by name, in the one written order
(``run/assemble.py``), and the planner's simulated step does the same (``planner/simulation.py``). A feature gives the planner
only what a simulation cannot see (``planner_cost``) and what it would suggest when nothing fits
(``alternatives``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Mapping, Optional

import torch
from torch import nn

from torchtune_ac.activation_checkpointing.config import ACConfig
from torchtune_ac.config_key import config_key
from torchtune_ac.parallel.fsdp import FSDPConfig

MakeOptimizer = Callable[[Iterable[nn.Parameter]], Any]


@dataclass(frozen=True)
class MemoryConfig:
    """The memory features' top-level config keys (activation checkpointing's are ``ACConfig``; CPU offload's is
    ``fsdp.cpu_offload``)."""

    optimizer_in_bwd: bool = config_key(
        False, doc="Step each parameter's optimizer in backward, as soon as its gradient is final, and free the "
        "gradient at once: the whole model's gradients never exist together. Needs clip_grad_norm: null.",
        torchtune="same")
    loss_chunks: Optional[int] = config_key(
        None, doc="Compute the loss's output projection and cross-entropy at the targets only (the labelled "
        "positions), this many chunks of them at a time, never the whole logits; null: 8 for a vocabulary of 32,000 "
        "tokens or more, else 1 (all targets at once).",
        minimum=1)
    enable_activation_offloading: bool = config_key(
        False, doc="Keep what checkpointed blocks save for backward in pinned host memory, copied back a block ahead "
        "in backward; CUDA only, with activation checkpointing.", torchtune="same")



@dataclass(frozen=True)
class OptimizerSpec:
    """The config's optimizer as written (``optimizer._component_`` and its arguments), for a feature that depends
    on which optimizer it is; nothing is imported or built from it."""

    path: str
    kwargs: Mapping[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class ResolveInputs:
    """What resolving a feature looks at: the keys (each feature reads its own) and the model.

    Attributes:
        ac: the activation-checkpointing keys (``ACConfig``).
        memory: the memory features' top-level keys (``MemoryConfig``).
        fsdp: the ``fsdp.*`` keys (``FSDPConfig``).
        model: the model the run trains (built, or on the meta device).
        vocab_size: the vocabulary the loss projects to (None for a model of no known family).
        clip_grad_norm: the config's value.
        settings: the settings of the features resolved before this one, by name (AC's plan under ``ac``), while
            the plan is resolved; the plan holds them typed (``MemorySettings``).
        optimizer: the config's optimizer (None where a plan is built without one, for AC alone).
        dtype: the storage dtype of parameters (``dtype``).
        device: the config's ``device`` (``auto``, ``cpu`` or ``cuda``): ``cpu`` is a choice the config made, and a
            CUDA-only feature refuses it here; what ``auto`` finds is checked by ``check_device``.
    """

    ac: ACConfig
    memory: "MemoryConfig"
    fsdp: FSDPConfig
    model: nn.Module
    vocab_size: Optional[int]
    clip_grad_norm: Optional[float]
    settings: Mapping[str, Any] = field(default_factory=dict)
    optimizer: Optional[OptimizerSpec] = None
    dtype: torch.dtype = torch.float32
    device: str = "auto"


@dataclass(frozen=True)
class Alternative:
    """A change the planner tries when nothing fits: the feature's new setting, and (rarely) other workload fields
    the change needs (``{"clip_grad_norm": None}`` with the step in backward)."""

    label: str
    setting: Any
    workload_changes: Mapping[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class FeatureCost:
    """What a feature adds to a simulated step's estimate, in bytes per process, by category (``parameters``,
    ``optimizer``, ``gradients``, ``activations``, ``transient``): ``device`` on the accelerator (negative: moved off
    it), ``host`` in the host's memory."""

    device: Mapping[str, int] = field(default_factory=dict)
    host: Mapping[str, int] = field(default_factory=dict)


@dataclass(frozen=True)
class ModelSizes:
    """What a feature's ``planner_cost`` may use: the model's sizes in bytes (whole model, not per process, unless
    said otherwise), and the estimate it changes.

    Attributes:
        parameters: every parameter.
        root_parameters: those outside the transformer blocks (embeddings, final norm, output).
        largest_block: one transformer block's.
        optimizer_state: the optimizer state as simulated (the stand-in's, where the optimizer cannot be simulated).
        world_size: processes each parameter is sharded over (FSDP2's shard degree: every process, or one row of
            HSDP's ``fsdp.replicate_degree`` rows); 1 when not sharded.
        shapes: the shape of every parameter that trains (a tied weight once; a frozen base has none), at the
            model's whole depth: what the optimizer keeps state for.
        dtype: the parameters' storage dtype.
        sharded: FSDP2 shards the model (several processes, or CPU offload on one).
        gathered_parameters: what FSDP2 holds gathered at once beyond nothing (the root and the running and
            prefetched blocks; every block without ``fsdp.reshard_after_forward``), unsharded; 0 when not sharded.
        checkpointed_blocks: the blocks the AC plan checkpoints (each keeps only its input for backward).
        block_input: bytes of one block's input for one micro-batch (per process).
        max_gradients: the most gradient bytes alive at one phase's peak (per process): all of them at the optimizer
            step after backward, a few with the step in backward.
        so_far: per process, on the device, by category: the simulated estimate with the features before this one
            counted.
    """

    parameters: int
    root_parameters: int
    largest_block: int
    optimizer_state: int
    world_size: int
    shapes: tuple[tuple[int, ...], ...] = ()
    dtype: torch.dtype = torch.float32
    sharded: bool = False
    gathered_parameters: int = 0
    checkpointed_blocks: int = 0
    block_input: int = 0
    max_gradients: int = 0
    so_far: Mapping[str, int] = field(default_factory=dict)


def runs_anywhere(setting: Any, device: torch.device) -> None:
    """``check_device`` of a feature that runs on every device."""


def costs_nothing_unseen(setting: Any, sizes: ModelSizes) -> FeatureCost:
    """``planner_cost`` of a feature whose whole cost the simulated step shows."""
    return FeatureCost()


def suggests_nothing(setting: Any) -> list[Alternative]:
    """``alternatives`` of a feature with nothing to suggest."""
    return []


def keeps_nothing(setting: Any) -> Mapping[str, Any]:
    """``resume_record`` of a feature whose setting may change between a run and its resume."""
    return {}


@dataclass(frozen=True)
class Feature:
    """One memory feature, as the plan and the planner see it.

    Attributes:
        name: its key in ``MemoryPlan.settings``.
        label: the label of its line in ``tune validate`` and the run's log.
        off: the setting that saves nothing (what a workload or a plan that does not name the feature means).
        resolve: its setting for this model and these keys; raises ``UserError`` naming the keys of a combination
            that cannot work.
        describe: the value of its ``tune validate`` line, given the setting and the model's vocabulary size.
        check_device: raises ``UnavailableError`` (one line naming the key) when the setting cannot run on the
            device the run found (``device: auto`` on a machine without CUDA is a CPU run).
        planner_cost: what the simulated step does not show (see ``FeatureCost``); the planner asks the features in
            order, each seeing the estimate with the earlier ones' costs (``ModelSizes.so_far``).
        alternatives: settings worth estimating when nothing fits, each labelled as a user would set it.
        resume_record: what a resume must keep of the setting (recorded in the checkpoint, compared on resume).
    """

    name: str
    label: str
    off: Any
    resolve: Callable[[ResolveInputs], Any]
    describe: Callable[[Any, Optional[int]], str]
    check_device: Callable[[Any, torch.device], None] = runs_anywhere
    planner_cost: Callable[[Any, ModelSizes], FeatureCost] = costs_nothing_unseen
    alternatives: Callable[[Any], list[Alternative]] = suggests_nothing
    resume_record: Callable[[Any], Mapping[str, Any]] = keeps_nothing
