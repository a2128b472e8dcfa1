"""The model families torchtune_ac knows, and how generic code finds a model's family.

To add a family: write ``families/<name>.py`` declaring a ``ModelFamily`` (see ``models/family.py``), list it
in ``FAMILIES`` below, and export its builders from ``torchtune_ac.models``.
"""

from __future__ import annotations

from typing import Any, Mapping, Optional

from torch import nn

from torchtune_ac.errors import UserError
from torchtune_ac.models.families.llama import LLAMA
from torchtune_ac.models.families.mistral import MISTRAL
from torchtune_ac.models.families.qwen2 import QWEN2
from torchtune_ac.models.family import ModelFamily

FAMILIES: tuple[ModelFamily, ...] = (LLAMA, QWEN2, MISTRAL)


def family_of(model: nn.Module) -> Optional[ModelFamily]:
    """The family ``model`` belongs to, or None for a model of no known family (an allowed custom component).

    The most specific class wins: a family whose model class subclasses another family's is found first.
    Wrapping by ``fully_shard`` (which subclasses the model's class) is seen through.
    """
    by_class = {family.model_class: family for family in FAMILIES}
    for cls in type(model).__mro__:
        if cls in by_class:
            return by_class[cls]
    return None


def supported_model_types() -> list[str]:
    return [family.hf.model_type for family in FAMILIES]


def family_for_hf_config(config: Mapping[str, Any]) -> ModelFamily:
    """The family whose adapter reads a config.json with this ``model_type``.

    Raises:
        UserError: no family reads it (the message lists the supported types).
    """
    model_type = config.get("model_type")
    for family in FAMILIES:
        if family.hf.model_type == model_type:
            return family
    supported = ", ".join(repr(t) for t in supported_model_types())
    raise UserError(f"model_type={model_type!r}: not a supported model family (supported: {supported})")


def require_family(model: nn.Module, what: str) -> ModelFamily:
    """``family_of(model)``, or a ``UserError`` saying that ``what`` needs a known family.

    Raises:
        UserError: the model is of no known family.
    """
    family = family_of(model)
    if family is None:
        names = ", ".join(f.name for f in FAMILIES)
        raise UserError(
            f"{what} needs a model of a known family ({names}); {type(model).__name__} is not one of them"
        )
    return family


def transformer_blocks(model: nn.Module) -> nn.ModuleList:
    """The transformer blocks of ``model``, which activation checkpointing and FSDP2 act on.

    A model of a known family answers through its family; any other model must keep its blocks in a
    non-empty ``layers`` ``nn.ModuleList`` (the convention custom models follow).

    Raises:
        UserError: a custom model without a non-empty ``layers`` ``nn.ModuleList``.
    """
    family = family_of(model)
    layers = family.blocks(model) if family is not None else getattr(model, "layers", None)
    if isinstance(layers, nn.ModuleList) and len(layers) > 0:
        return layers
    if layers is None:
        found = "no attribute 'layers'"
    elif isinstance(layers, nn.ModuleList):
        found = "an empty 'layers'"
    else:
        found = f"'layers' of type {type(layers).__name__}"
    raise UserError(
        "activation checkpointing and sharding need a model whose 'layers' attribute is a non-empty nn.ModuleList "
        f"of transformer blocks; {type(model).__name__} has {found}"
    )


def init_weights_(model: nn.Module) -> None:
    """Initialise every parameter of ``model`` in place, through its family (custom models: ``init_weights()``).

    Raises:
        UserError: a custom model without ``init_weights()``.
    """
    family = family_of(model)
    if family is not None:
        family.init_weights(model)
    elif callable(getattr(model, "init_weights", None)):
        model.init_weights()
    else:
        raise UserError(
            f"{type(model).__name__} has no init_weights() and is of no known family: "
            "set checkpoint_dir to start from its weights"
        )


def retie_parameters(model: nn.Module) -> None:
    """Tie again the parameters that ``to_empty`` untied (it gives every parameter its own new tensor).

    A model of a known family re-ties what its adapter declares tied; any other model is asked to
    ``tie_weights()`` if it has that method. A model sharded by FSDP2 keeps its ties: do not call this on one.
    """
    family = family_of(model)
    if family is None:
        if callable(getattr(model, "tie_weights", None)):
            model.tie_weights()
        return
    for alias, source in family.hf.tied_parameters(family.args_of(model)).items():
        owner, _, attr = alias.rpartition(".")
        setattr(model.get_submodule(owner), attr, model.get_parameter(source))
