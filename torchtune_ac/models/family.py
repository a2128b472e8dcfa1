"""The model-family interface: everything generic code (activation checkpointing, sharding, Hugging Face load
and save, start-up checks) may know about a family of models.

A family declares:

- the ``model_type`` its models carry in their arguments (a model's family is found by it, not by its class)
  and the config.json ``model_type`` values it reads;
- its named builders, and the torchtune builders they replace (``tune migrate`` reads them);
- a pure Hugging Face adapter (``HFAdapter``): parameter names both ways, how its checkpoints store them (as
  data, in ``checkpoint/layout.py``'s vocabulary) and ``config.json`` to and from the model's arguments, with no
  file or network access;
- which modules are its transformer blocks (activation checkpointing and FSDP2 act on them), and which of its
  other modules FSDP2 shards as groups of their own (the embeddings; the final norm with the output layer);
- how its weights are initialised;
- its tensor-parallel plan (``models/tensor_parallel.py``): which modules are split across a tensor-parallel
  group, and how.

Generic code asks ``family_of(model)`` (``torchtune_ac.models.families``) and goes through the answer; it
never reads a family's attributes (``model.args``, ``model.layers``) itself. Adding a family means writing
one module under ``torchtune_ac/models/families/`` that declares ``FAMILY``, listed in that package's ``FAMILIES``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Optional, Protocol

import torch
from torch import nn

from torchtune_ac.checkpoint.layout import StorageRule
from torchtune_ac.models.tensor_parallel import TensorParallelPlan


class HFAdapter(Protocol):
    """Translation between a family's models and the Hugging Face layout. Pure: no I/O, no collectives."""

    #: ``model_type`` of the config.json files this adapter writes, carried by the family's model arguments.
    model_type: str
    #: every config.json ``model_type`` this adapter reads (``model_type`` first).
    model_types_read: tuple[str, ...]
    #: config.json ``model_type`` values of checkpoints that another family is found by, but that this family's
    #: models load whole when a builder chose it (a multimodal Gemma 3 checkpoint: the text family builds its text
    #: tower, the vision-language family loads it all); empty for most families.
    model_types_loaded: tuple[str, ...]
    #: how its checkpoints store the parameters not stored whole under their ``to_hf_name`` names, as data
    #: (``checkpoint/layout.py``'s rules: stacked, split in parts, encoded); empty for most families.
    storage: tuple[StorageRule, ...]

    def to_hf_name(self, name: str) -> str:
        """Our parameter name -> the Hugging Face tensor name. Raises ``ValueError`` for an unknown name."""

    def stored_name(self, config: Mapping[str, Any], name: str) -> Optional[str]:
        """A tensor found in a checkpoint with this config.json -> its name in the family's stored layout (the name
        itself, most often); None for a tensor that is not loaded: derived, not learned (stored rotary
        frequencies), or of another model in the same files (a multimodal checkpoint's vision tower)."""

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
class TorchtuneBuilder:
    """A torchtune model builder a family replaces (``tune migrate``).

    Attributes:
        ours: the name of our builder under ``torchtune_ac.models`` (``llama3_8b``, or ``from_hf_config``).
        note: why it is another builder than torchtune's of the same name, printed as a "changed" note; None
            when it is the same model.
    """

    ours: str
    note: Optional[str] = None


@dataclass(frozen=True)
class ImageInputs:
    """How a vision-language family's images reach its model, as the memory planner lays out a batch of them.

    Attributes:
        resized: ``(args, height, width) -> (height, width, tokens)``: the size an image reaches the model in, as
            the family's processor rounds it, and its image tokens.
        batch: ``(args, rows, seq_len, per_row, height, width) -> inputs``: a batch with ``per_row`` such images
            in every row (``tokens`` and the forward's image arguments), made of shapes only, so that it can be
            made under fake tensors.
        default_max_pixels: the most pixels the family's processor passes when its files do not say
            (transformers' default for it); None: the processor resizes every image to one size (Gemma 3's), which
            ``resized`` gives whatever it is asked.
    """

    resized: Callable[[Any, int, int], tuple[int, int, int]]
    batch: Callable[[Any, int, int, int, int, int], dict[str, Any]]
    default_max_pixels: Optional[int]


@dataclass(frozen=True)
class ModelFamily:
    """One family of models, as generic code sees it.

    Attributes:
        name: short name used in messages (``llama``).
        model_class: the ``nn.Module`` class of the family's models, shared by every family built on the same
            decoder: a model is of this family when it is an instance of this class and its arguments carry
            the family's ``model_type`` (``hf.model_type``).
        builders: named builders (``{"llama3_8b": llama3_8b, ...}``), each a config component, exported from
            ``torchtune_ac.models``.
        hf: the pure Hugging Face adapter.
        args_of: the arguments a model was built from (what ``hf`` translates); they carry ``model_type``.
        build: a model from arguments (on the current default device, weights uninitialised). Raises
            ``ValueError`` for arguments of another family, or that contradict the family (Qwen2 without its
            q/k/v biases).
        blocks: the model's transformer blocks, in order: activation checkpointing and FSDP2 act on them.
        shard_groups: the modules outside the blocks that FSDP2 shards as groups of their own, each group a tuple
            of modules whose parameters are gathered together, in the order forward runs them (the embeddings
            before the blocks; the final norm and the output layer after). Every module of a group must run in
            every forward, and a tied parameter belongs to one group only: modules sharing a weight are in the
            same group, or in none (what no group holds stays with the root). Empty: the root holds it all.
        init_weights: initialise every parameter in place (called under a seeded RNG).
        init_parameter: ``(model, name, tensor, generator)``: fill ``tensor``, the full shape of parameter ``name``,
            as ``init_weights`` initialises it, drawing from ``generator`` (how a sharded model is initialised one
            parameter at a time, the same for any world size and device).
        vision_modules: the model's attributes that hold its vision side (tower and projector; Qwen2.5-VL's
            ``visual``): adapters' targets resolve outside them, on the language model. Empty: a text-only family.
        tensor_parallel_plan: the plan of a model built from these arguments (``models/tensor_parallel.py``);
            None: the family cannot be split by tensor parallelism.
        torchtune_builders: torchtune builder (``torchtune.models.llama3.llama3_8b``) -> ours, for
            ``tune migrate``.
        torchtune_packages: torchtune model packages (``torchtune.models.qwen2_5``) whose every full-model builder
            is of this family's architecture: ``tune migrate`` makes those absent from ``torchtune_builders``
            ``from_hf_config`` over their checkpoint (whose config.json gives the shapes).
        images: how its images reach the model (``ImageInputs``); None: a text-only family.
    """

    name: str
    model_class: type[nn.Module]
    builders: Mapping[str, Callable[..., nn.Module]]
    hf: HFAdapter
    args_of: Callable[[nn.Module], Any]
    build: Callable[[Any], nn.Module]
    blocks: Callable[[nn.Module], nn.ModuleList]
    init_weights: Callable[[nn.Module], None]
    init_parameter: Callable[[nn.Module, str, torch.Tensor, torch.Generator], None]
    shard_groups: Callable[[nn.Module], tuple[tuple[nn.Module, ...], ...]] = lambda model: ()
    vision_modules: tuple[str, ...] = ()
    tensor_parallel_plan: Optional[Callable[[Any], TensorParallelPlan]] = None
    torchtune_builders: Mapping[str, TorchtuneBuilder] = field(default_factory=dict)
    torchtune_packages: tuple[str, ...] = ()
    images: Optional[ImageInputs] = None

    def owns(self, model: nn.Module) -> bool:
        """Whether ``model`` is of this family (wrapping by ``fully_shard``, a subclass of the model's class, is
        seen through)."""
        return isinstance(model, self.model_class) and getattr(self.args_of(model), "model_type", None) == (
            self.hf.model_type
        )


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
