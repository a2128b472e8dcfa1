"""Build the model to train, in the one order that works for 1 and N processes.

    build on the meta device -> cast to the storage dtype -> activation checkpointing -> compile (optional)
    -> FSDP2 per block, then root (N > 1) -> allocate on the device -> load Hugging Face weights (each rank
    reads only its own shard) or initialise from the seed.

AC comes first so that compile traces each checkpointed forward (per-op policy included) and the FSDP hooks
wrap the checkpointed blocks; nothing is materialised before sharding, so no rank ever holds the full model.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch
from torch import nn

from torchtune_ac.config.components import Component
from torchtune_ac.errors import UserError
from torchtune_ac.models import load_hf_weights_
from torchtune_ac.models.hf_interop import local_region
from torchtune_ac.models.llama import TransformerBlock
from torchtune_ac.training.activation_checkpointing import (
    ACPlan,
    apply_ac_plan,
    resolve_ac_plan,
    silence_compiled_policy_warning,
)
from torchtune_ac.training.distributed import DistributedContext, shard_model

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


@dataclass(frozen=True)
class ACSettings:
    """The three activation-checkpointing config keys, as given."""

    enable_activation_checkpointing: Optional[bool] = None
    ac_mode: Optional[str] = None
    ac_option: Any = None


def build_meta_model(model: Component) -> nn.Module:
    """Instantiate the model component on the meta device (no memory, no initialisation).

    Raises:
        UserError: the component did not return an ``nn.Module`` with a ``layers`` ``nn.ModuleList``.
    """
    with torch.device("meta"):
        built = model.instantiate()
    if not isinstance(built, nn.Module) or not isinstance(getattr(built, "layers", None), nn.ModuleList):
        raise UserError(f"model ({model.path}): must return an nn.Module with a `layers` nn.ModuleList of blocks")
    return built


def plan_activation_checkpointing(settings: ACSettings, n_layers: int) -> ACPlan:
    """Resolve the AC keys for a model with ``n_layers`` blocks (raises ``UserError`` on bad values)."""
    return resolve_ac_plan(
        enable_activation_checkpointing=settings.enable_activation_checkpointing,
        ac_mode=settings.ac_mode,
        ac_option=settings.ac_option,
        n_layers=n_layers,
    )


def count_parameters(model: nn.Module) -> int:
    """Number of distinct parameters (a tied weight counts once; works on meta and sharded models)."""
    return sum(p.numel() for p in model.parameters())


def build_training_model(
    model: Component,
    *,
    ctx: DistributedContext,
    dtype: str,
    ac: ACSettings,
    compile_blocks: bool,
    checkpoint_dir: Optional[str],
    seed: int,
    initialize: bool = True,
    reshard_after_forward: bool = True,
    param_dtype: Optional[str] = None,
    reduce_dtype: str = "fp32",
) -> tuple[nn.Module, ACPlan]:
    """Build, checkpoint, shard and load the model (see the module docstring for the order).

    Args:
        model: the ``model`` config component.
        ctx: rank, world size and device.
        dtype: storage dtype of parameters (``fp32`` / ``bf16``).
        ac: the activation-checkpointing keys.
        compile_blocks: ``torch.compile`` each block in place (state_dict keys unchanged).
        checkpoint_dir: Hugging Face checkpoint to load, or None to initialise from ``seed``.
        seed: seed for initialisation when there is no checkpoint.
        initialize: initialise when there is no checkpoint; False leaves the weights unset for the caller to
            load (resuming from recipe state).
        reshard_after_forward, param_dtype, reduce_dtype: FSDP2 settings (used when world size > 1).

    Returns:
        The model on ``ctx.device`` in training mode, and the applied AC plan.
    """
    built = build_meta_model(model).to(DTYPES[dtype])
    plan = plan_activation_checkpointing(ac, len(built.layers))
    apply_ac_plan(built, plan)
    if compile_blocks:
        if plan.policy is not None and all(isinstance(b, TransformerBlock) for b in built.layers):
            silence_compiled_policy_warning()
        for block in built.layers:
            block.compile()
    if ctx.is_distributed:
        shard_model(
            built,
            reshard_after_forward=reshard_after_forward,
            param_dtype=DTYPES[param_dtype] if param_dtype else None,
            reduce_dtype=DTYPES[reduce_dtype],
        )
    built.to_empty(device=ctx.device)
    if not ctx.is_distributed and hasattr(built, "tie_weights"):
        built.tie_weights()  # FSDP keeps the tie through to_empty; a plain module does not
    if checkpoint_dir is not None:
        load_hf_weights_(built, checkpoint_dir)
    elif initialize:
        initialize_weights_(built, model, dtype=DTYPES[dtype], seed=seed, sharded=ctx.is_distributed)
    built.train()
    return built, plan


@torch.no_grad()
def initialize_weights_(
    built: nn.Module, model: Component, *, dtype: torch.dtype, seed: int, sharded: bool
) -> None:
    """Initialise ``built`` from ``seed`` with its ``init_weights()``: the same weights whatever the world size.

    A sharded model cannot call ``init_weights()`` itself: DTensor random ops are not sharding-aware on CPU, so
    every rank would draw its shard from the same RNG state and every shard would hold the same values. Each rank
    instead initialises a full copy on CPU and keeps its own region of every parameter. That copy costs the
    model's size in host memory once; start large models from a checkpoint.

    Raises:
        UserError: the model has no ``init_weights()``.
    """
    if not hasattr(built, "init_weights"):
        raise UserError(f"checkpoint_dir is null and model ({model.path}) has no init_weights(): set checkpoint_dir")
    if not sharded:
        torch.manual_seed(seed)
        built.init_weights()
        return
    full = build_meta_model(model).to(dtype)
    full.to_empty(device="cpu")
    if hasattr(full, "tie_weights"):
        full.tie_weights()
    torch.manual_seed(seed)
    full.init_weights()
    full_params = dict(full.named_parameters())
    for name, param in built.named_parameters():
        local, region = local_region(param)
        local.copy_(full_params[name][region])
