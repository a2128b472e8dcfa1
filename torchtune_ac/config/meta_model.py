"""The model a config names, built on the meta device: its sizes and blocks without memory or weights (start-up
checks, ``tune plan``, and the first phase of building the model to train)."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Mapping, Optional, Protocol

import torch
from torch import nn

from torchtune_ac.errors import UserError
from torchtune_ac.models.families import family_of, transformer_blocks


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


@dataclass(frozen=True)
class ModelFacts:
    """What the one meta build of the model says.

    Attributes:
        builder: the ``model`` component's path.
        parameters: distinct parameters (a tied weight once).
        layers: transformer blocks.
        vocab_size: the vocabulary its loss projects to (None for a model of no known family).
        positions: the positions it was trained for (its family's ``max_seq_len``; None when unknown).
        architecture: what defines its weights, as its family's adapter says (empty for no known family); a resume
            must keep it.
    """

    builder: str
    parameters: int
    layers: int
    vocab_size: Optional[int]
    positions: Optional[int]
    architecture: Mapping[str, Any] = field(default_factory=dict)


def model_facts(model: nn.Module, builder: str) -> ModelFacts:
    """The facts of ``model`` (built on the meta device by the ``builder`` component)."""
    family = family_of(model)
    args = family.args_of(model) if family is not None else None
    architecture = family.hf.architecture(args) if family is not None else {}
    # As it reads back from trainer_state.json (tuples become lists), so a resume compares like with like.
    architecture = json.loads(json.dumps(architecture))
    return ModelFacts(builder, count_parameters(model), len(transformer_blocks(model)),
                      architecture.get("vocab_size"), getattr(args, "max_seq_len", None), architecture)
