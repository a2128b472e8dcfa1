"""The model families torchtune_ac knows, and how generic code finds a model's family.

Every module in this package is one family: it declares ``FAMILY``, a ``ModelFamily`` (see ``models/family.py``),
and is listed once below (``FAMILIES``), so adding a family is its module and its line there;
``torchtune_ac.models`` exports each family's builders, and ``tune migrate`` reads the torchtune builders each
replaces.

Everything here is pure: a model's family is found by the ``model_type`` its arguments carry, and a config.json
(already parsed) is turned into a model by the family its ``model_type`` names.
"""

from __future__ import annotations

import functools
from typing import Any, Callable, Mapping, Optional, Sequence

import torch
from torch import nn

from torchtune_ac.errors import UserError
from torchtune_ac.models.families import (gemma, gemma2, gemma3, gpt_oss, llama, mistral, phi3, qwen2, qwen2_5_vl, qwen3,
                                          qwen3_moe, qwen3_vl)
from torchtune_ac.models.families import gemma3_vision
from torchtune_ac.models.family import ModelFamily
from torchtune_ac.models.moe import GroupedExperts, MoE


def check_distinct(families: Sequence[ModelFamily]) -> tuple[ModelFamily, ...]:
    """``families``, once no two of them claim one name, builder or ``model_type``.

    Raises:
        TypeError: naming the key and the two families.
    """
    for what, keys in (("name", lambda f: [f.name]), ("builder", lambda f: list(f.builders)),
                       ("model_type", lambda f: list(f.hf.model_types_read))):
        seen: dict[str, str] = {}
        for family in families:
            for key in keys(family):
                if key in seen:
                    raise TypeError(f"{what} {key!r} is claimed by families {seen[key]} and {family.name}")
                seen[key] = family.name
    return tuple(families)


# Llama first (the decoder the others share), then by name.
FAMILIES: tuple[ModelFamily, ...] = check_distinct(
    (llama.FAMILY, gemma.FAMILY, gemma2.FAMILY, gemma3.FAMILY, gemma3_vision.FAMILY, gpt_oss.FAMILY, mistral.FAMILY,
     phi3.FAMILY, qwen2.FAMILY, qwen2_5_vl.FAMILY, qwen3.FAMILY, qwen3_moe.FAMILY, qwen3_vl.FAMILY))


def family_of(model: nn.Module) -> Optional[ModelFamily]:
    """The family ``model`` belongs to, or None for a model of no known family (an allowed custom component).

    A model is of the family whose model class it is an instance of (wrapping by ``fully_shard``, which subclasses
    the model's class, is seen through) and whose ``model_type`` its arguments carry.
    """
    return next((family for family in FAMILIES if family.owns(model)), None)


def supported_model_types() -> list[str]:
    return [model_type for family in FAMILIES for model_type in family.hf.model_types_read]


def family_for_hf_config(config: Mapping[str, Any]) -> ModelFamily:
    """The family whose adapter reads a config.json with this ``model_type``.

    Raises:
        UserError: no family reads it (the message lists the supported types).
    """
    model_type = config.get("model_type")
    for family in FAMILIES:
        if model_type in family.hf.model_types_read:
            return family
    supported = ", ".join(repr(t) for t in supported_model_types())
    raise UserError(f"model_type={model_type!r}: not a supported model family (supported: {supported})")


def args_from_hf_config(config: Mapping[str, Any], **overrides: Any) -> tuple[ModelFamily, Any]:
    """The family a parsed config.json names, and the model arguments it describes.

    Args:
        config: the parsed config.json.
        **overrides: argument fields to set instead of what the config says (e.g. ``attn_dropout``).

    Raises:
        UserError: an unsupported ``model_type`` (listing the supported ones), or a config the family's adapter
            refuses (naming each key).
    """
    family = family_for_hf_config(config)
    return family, family.hf.args_from_hf_config(config, **overrides)


def model_from_hf_config(config: Mapping[str, Any], **overrides: Any) -> nn.Module:
    """The model a parsed config.json describes, of whichever family its ``model_type`` names, built on the
    current default device with its weights unset.

    Raises:
        UserError: as ``args_from_hf_config``.
    """
    family, args = args_from_hf_config(config, **overrides)
    return family.build(args)


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


def expert_modules(model: nn.Module) -> list[GroupedExperts]:
    """Every mixture-of-experts layer's experts, in layer order (what expert parallelism splits, and FSDP2 shards
    over the processes that hold the same experts)."""
    return [module.experts for module in model.modules() if isinstance(module, MoE)]


def shard_groups(model: nn.Module) -> tuple[tuple[nn.Module, ...], ...]:
    """The modules outside the blocks that FSDP2 shards as groups of their own, in forward order (see
    ``ModelFamily.shard_groups``); none for a model of no known family (its root holds them)."""
    family = family_of(model)
    return family.shard_groups(model) if family is not None else ()


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


def parameter_initializer(model: nn.Module) -> Optional[Callable[[str, torch.Tensor, torch.Generator], None]]:
    """How ``model`` initialises one parameter at a time: ``init(name, tensor, generator)`` fills ``tensor``, the
    full shape of parameter ``name``, drawing from ``generator``. Through its family; a custom model through its
    ``init_parameter_(name, tensor, generator)`` method; None for a custom model without one."""
    family = family_of(model)
    if family is not None:
        return functools.partial(family.init_parameter, model)
    method = getattr(model, "init_parameter_", None)
    return method if callable(method) else None


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
