"""The model a config names, built on the meta device: its sizes and blocks without memory or weights (start-up
checks, ``tune plan``, and the first phase of building the model to train)."""

from __future__ import annotations

from typing import Any, Optional, Protocol

import torch
from torch import nn

from torchtune_ac.errors import UserError
from torchtune_ac.models.families import transformer_blocks


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
