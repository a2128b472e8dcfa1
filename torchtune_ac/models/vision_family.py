"""Declaring a vision-language family: a tower and a projector beside the Llama decoder, named by attribute path
(``VisionParts``), and its ``ModelFamily`` and builders, from data.

Its builders take ``decoder_family``'s keywords and two more: ``freeze_vision_tower`` stops training the tower,
``freeze_projector`` the projector. Activation checkpointing and FSDP2 see the tower's blocks, then the decoder's
(the order forward runs them).
"""

import dataclasses
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Optional

from torch import nn

from torchtune_ac.component_marker import config_component
from torchtune_ac.errors import UserError
from torchtune_ac.models.decoder_family import decoder_shard_groups
from torchtune_ac.models.family import ImageInputs, ModelFamily
from torchtune_ac.models.hf_adapter import LlamaStyleHFAdapter

# No ``from __future__ import annotations`` here: the builders' annotations must be types (see decoder_family).


@dataclass(frozen=True)
class VisionParts:
    """Where a vision-language model holds its vision side, as attribute paths (``visual.blocks``).

    Attributes:
        tower: what ``freeze_vision_tower`` stops training.
        projector: what ``freeze_projector`` stops training.
        tower_blocks: the tower's blocks (a ``ModuleList``), run before the decoder's.
        shard_groups: the vision modules outside the blocks that FSDP2 shards as groups, in the order forward runs
            them; a group of one ``ModuleList`` is one group per member (Qwen3-VL's DeepStack mergers). The
            decoder's groups follow (``decoder_shard_groups``).
    """

    tower: tuple[str, ...]
    projector: tuple[str, ...]
    tower_blocks: str
    shard_groups: tuple[tuple[str, ...], ...]

    def freeze_(self, model: nn.Module, *, vision_tower: bool, projector: bool) -> nn.Module:
        """Stop training the tower and/or the projector of ``model``; returns it."""
        for path in (*(self.tower if vision_tower else ()), *(self.projector if projector else ())):
            model.get_submodule(path).requires_grad_(False)
        return model

    def blocks(self, model: nn.Module) -> nn.ModuleList:
        """The tower's blocks, then the decoder's."""
        return nn.ModuleList([*model.get_submodule(self.tower_blocks), *model.layers])

    def groups(self, model: nn.Module) -> tuple[tuple[nn.Module, ...], ...]:
        """``ModelFamily.shard_groups``: the vision groups, then the decoder's."""
        vision: list[tuple[nn.Module, ...]] = []
        for group in self.shard_groups:
            modules = tuple(model.get_submodule(path) for path in group)
            if len(modules) == 1 and isinstance(modules[0], nn.ModuleList):
                vision += [(member,) for member in modules[0]]
            else:
                vision.append(modules)
        return (*vision, *decoder_shard_groups(model))


def _vision_builder(module: str, name: str, base: Any, doc: str, build: Callable[[Any], nn.Module],
                    model_class: type[nn.Module], parts: VisionParts) -> Callable[..., nn.Module]:
    """A builder of the published model ``base`` (named ``name`` in ``module``, documented by ``doc``), marked as a
    config component; it returns a ``model_class``."""

    def builder(*, attn_dropout: float = 0.0, resid_dropout: float = 0.0, max_seq_len: int | None = None,
                freeze_vision_tower: bool = False, freeze_projector: bool = False) -> nn.Module:
        try:
            args = dataclasses.replace(base, attn_dropout=attn_dropout, resid_dropout=resid_dropout,
                                       max_seq_len=base.max_seq_len if max_seq_len is None else max_seq_len)
        except ValueError as e:
            raise UserError(f"model {name}: {e}") from None
        return parts.freeze_(build(args), vision_tower=freeze_vision_tower, projector=freeze_projector)

    builder.__module__, builder.__name__, builder.__qualname__, builder.__doc__ = module, name, name, doc
    builder.__annotations__ = {**builder.__annotations__, "return": model_class}
    return config_component(builder)


def vision_family(module: str, name: str, model_class: type[nn.Module], hf: LlamaStyleHFAdapter,
                  published: Mapping[str, tuple[Any, str]], parts: VisionParts, *, freeze_doc: str,
                  vision_modules: tuple[str, ...], images: Optional[ImageInputs] = None) -> ModelFamily:
    """The ``ModelFamily`` of a vision-language family on the Llama decoder.

    Args:
        module: the family module (``__name__``), where its builders are defined.
        name: the family's short name (``qwen2_5_vl``).
        model_class: its model class, built from its arguments.
        hf: its Hugging Face adapter.
        published: builder name -> (published arguments, docstring); ``freeze_doc`` is appended to each.
        parts: where its models hold their tower and projector.
        freeze_doc: what the two freezing keywords stop training, for the builders' docstrings.
        vision_modules: ``ModelFamily.vision_modules``.
        images: ``ModelFamily.images``.
    """

    def build(args: Any) -> nn.Module:
        hf.check_args(args)
        return model_class(args)

    return ModelFamily(
        name=name,
        model_class=model_class,
        builders={n: _vision_builder(module, n, args, doc + freeze_doc, build, model_class, parts)
                  for n, (args, doc) in published.items()},
        hf=hf,
        args_of=lambda model: model.args,
        build=build,
        blocks=parts.blocks,
        shard_groups=parts.groups,
        vision_modules=vision_modules,
        init_weights=lambda model: model.init_weights(),
        init_parameter=lambda model, name, tensor, generator: model.init_parameter_(name, tensor, generator),
        images=images,
    )
