"""The model-family interface: everything generic code (activation checkpointing, sharding, Hugging Face load
and save, start-up checks) may know about a family of models.

A family declares:

- its model class and named builders;
- a pure Hugging Face adapter (``HFAdapter``): parameter names both ways and ``config.json`` to and from the
  model's arguments, with no file or network access;
- which modules are its transformer blocks (activation checkpointing and FSDP2 act on them);
- how its weights are initialised.

Generic code asks ``family_of(model)`` (``torchtune_ac.models.families``) and goes through the answer; it
never reads a family's attributes (``model.args``, ``model.layers``) itself. Adding a family means writing
one module under ``torchtune_ac/models/families/`` and listing it there.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Optional, Protocol

import torch
from torch import nn


class HFAdapter(Protocol):
    """Translation between a family's models and the Hugging Face layout. Pure: no I/O, no collectives."""

    #: ``model_type`` in the config.json files this adapter reads and writes.
    model_type: str

    def to_hf_name(self, name: str) -> str:
        """Our parameter name -> the Hugging Face tensor name. Raises ``ValueError`` for an unknown name."""

    def is_derived_hf_tensor(self, hf_name: str) -> bool:
        """Whether a tensor found in a checkpoint is derived, not learned (e.g. stored rotary frequencies), and is
        skipped when loading."""

    def args_from_hf_config(self, config: Mapping[str, Any], **overrides: Any) -> Any:
        """The model's arguments from a parsed config.json. Raises ``UserError`` listing every problem."""

    def hf_config_from_args(self, args: Any, dtype: torch.dtype, *, base_config: Optional[Mapping[str, Any]] = None,
                            **token_ids: Any) -> dict[str, Any]:
        """A config.json (as a dict) that transformers loads, for ``args`` and weights of ``dtype``; the keys of
        ``base_config`` (the config.json the model came from) that it does not write itself are kept."""

    def architecture(self, args: Any) -> dict[str, Any]:
        """The config.json keys and values that give weights their meaning (shapes, head layout, RoPE, norm,
        tying), without run-time settings such as dropout or the maximum sequence length. Two models whose
        architectures are equal can exchange weights."""

    def tied_parameters(self, args: Any) -> dict[str, str]:
        """Parameters that are another parameter (``{"output.weight": "tok_embeddings.weight"}`` when
        embeddings are tied): saved once, under the second name."""


@dataclass(frozen=True)
class ModelFamily:
    """One family of models, as generic code sees it.

    Attributes:
        name: short name used in messages (``llama``).
        model_class: the ``nn.Module`` class of the family's models (a model is of this family when it is an
            instance of this class and of no more specific family's class).
        builders: named builders (``{"llama3_8b": llama3_8b, ...}``), each a config component.
        hf: the pure Hugging Face adapter.
        args_of: the arguments a model was built from (what ``hf`` translates).
        build: a model from arguments (on the current default device, weights uninitialised).
        blocks: the model's transformer blocks, in order: activation checkpointing and FSDP2 act on them.
        init_weights: initialise every parameter in place (called under a seeded RNG).
    """

    name: str
    model_class: type[nn.Module]
    builders: Mapping[str, Callable[..., nn.Module]]
    hf: HFAdapter
    args_of: Callable[[nn.Module], Any]
    build: Callable[[Any], nn.Module]
    blocks: Callable[[nn.Module], nn.ModuleList]
    init_weights: Callable[[nn.Module], None]


def architecture_mismatches(ours: Mapping[str, Any], theirs: Mapping[str, Any]) -> list[str]:
    """Keys of two ``HFAdapter.architecture`` dicts whose values differ (floats compared to 1e-6 relative).

    Returns:
        ``"key=THEIRS, model has OURS"`` for each difference, in key order; empty when they match.
    """
    problems = []
    for key in sorted(ours.keys() | theirs.keys()):
        a, b = ours.get(key), theirs.get(key)
        if _same(a, b):
            continue
        problems.append(f"{key}={_show(b)}, model has {_show(a)}")
    return problems


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, float) and isinstance(b, (int, float)) and not isinstance(b, bool):
        return math.isclose(a, b, rel_tol=1e-6)
    return a == b


def _show(value: Optional[Any]) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)
