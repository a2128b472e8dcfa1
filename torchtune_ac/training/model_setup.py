"""Build the model to train, in the one order that works for 1 and N processes.

    build on the meta device -> cast to the storage dtype -> activation checkpointing -> compile (optional)
    -> FSDP2 per block, then root (N > 1) -> allocate on the device -> load Hugging Face weights (each rank
    reads only its own shard) or initialise from the seed.

AC comes first so that compile traces each checkpointed forward (per-op policy included) and the FSDP hooks
wrap the checkpointed blocks; nothing is materialised before sharding, so no rank ever holds the full model.
The model's family (``torchtune_ac.models.families``) says which modules are its blocks and how it initialises.
"""

from __future__ import annotations

from typing import Any, Optional, Protocol

import torch
from torch import nn

from torchtune_ac.checkpoint import local_region
from torchtune_ac.errors import UserError
from torchtune_ac.models import load_hf_weights_
from torchtune_ac.models.families import init_weights_, retie_parameters, transformer_blocks
from torchtune_ac.models.llama import TransformerBlock
from torchtune_ac.training.activation_checkpointing import ACPlan, apply_ac_plan, silence_compiled_policy_warning
from torchtune_ac.training.distributed import DistributedContext, FSDPConfig, shard_model
from torchtune_ac.training.dtypes import DType


class ModelBuilder(Protocol):
    """What builds the model: a config's ``model`` component (``torchtune_ac.config.Component``)."""

    path: str

    def instantiate_with_defaults(self, **defaults: Any) -> Any:
        """Call the builder; each default is passed only if the builder takes it and the config does not set it."""


def build_meta_model(model: ModelBuilder, checkpoint_dir: Optional[str] = None) -> nn.Module:
    """Instantiate the model component on the meta device (no memory, no initialisation).

    A builder that takes a ``checkpoint_dir`` argument (``from_hf_config``) gets the run's, unless the config sets
    its own.

    Raises:
        UserError: the component did not return an ``nn.Module`` whose transformer blocks can be found.
    """
    with torch.device("meta"):
        built = model.instantiate_with_defaults(checkpoint_dir=checkpoint_dir)
    if not isinstance(built, nn.Module):
        raise UserError(f"model ({model.path}): must return an nn.Module, not {type(built).__name__}")
    transformer_blocks(built)
    return built


def count_parameters(model: nn.Module) -> int:
    """Number of distinct parameters (a tied weight counts once; works on meta and sharded models)."""
    return sum(p.numel() for p in model.parameters())


def build_training_model(
    model: ModelBuilder,
    *,
    ctx: DistributedContext,
    dtype: DType,
    ac: ACPlan,
    fsdp: FSDPConfig,
    compile_blocks: bool,
    checkpoint_dir: Optional[str],
    load_weights: bool = True,
    seed: int,
) -> nn.Module:
    """Build, checkpoint, shard and load the model (see the module docstring for the order).

    Args:
        model: the ``model`` config component.
        ctx: rank, world size and device.
        dtype: storage dtype of parameters.
        ac: the activation-checkpointing plan (``MemoryPlan.ac``), resolved for this model's layer count.
        fsdp: FSDP2 settings (used when world size > 1).
        compile_blocks: ``torch.compile`` each block in place (state_dict keys unchanged).
        checkpoint_dir: the run's Hugging Face checkpoint: the weights when ``load_weights``, and the config.json
            of ``from_hf_config``; None to initialise from ``seed``.
        load_weights: fill the weights (from ``checkpoint_dir`` or ``seed``); False leaves them unset for the
            caller to load (resuming from recipe state).
        seed: seed for initialisation when there is no checkpoint.

    Returns:
        The model on ``ctx.device`` in training mode.
    """
    built = build_meta_model(model, checkpoint_dir).to(dtype.torch)
    blocks = transformer_blocks(built)
    apply_ac_plan(built, ac)
    if compile_blocks:
        if ac.policy is not None and all(isinstance(b, TransformerBlock) for b in blocks):
            silence_compiled_policy_warning()
        for block in blocks:
            block.compile()
    if ctx.is_distributed:
        shard_model(built, fsdp)
    built.to_empty(device=ctx.device)
    if not ctx.is_distributed:
        retie_parameters(built)  # FSDP keeps ties through to_empty; a plain module does not
    if load_weights and checkpoint_dir is not None:
        load_hf_weights_(built, checkpoint_dir)
    elif load_weights:
        initialize_weights_(built, model, dtype=dtype.torch, seed=seed, sharded=ctx.is_distributed)
    built.train()
    return built


@torch.no_grad()
def initialize_weights_(built: nn.Module, model: ModelBuilder, *, dtype: torch.dtype, seed: int, sharded: bool) -> None:
    """Initialise ``built`` from ``seed`` through its family: the same weights whatever the world size.

    A sharded model cannot initialise itself: DTensor random ops are not sharding-aware on CPU, so every rank
    would draw its shard from the same RNG state and every shard would hold the same values. Each rank instead
    initialises a full copy on CPU and keeps its own region of every parameter. That copy costs the model's size
    in host memory once; start large models from a checkpoint.

    Raises:
        UserError: a custom model with no ``init_weights()``.
    """
    if not sharded:
        torch.manual_seed(seed)
        init_weights_(built)
        return
    full = build_meta_model(model).to(dtype)
    full.to_empty(device="cpu")
    retie_parameters(full)
    torch.manual_seed(seed)
    init_weights_(full)
    full_params = dict(full.named_parameters())
    for name, param in built.named_parameters():
        local, region = local_region(param)
        local.copy_(full_params[name][region])
