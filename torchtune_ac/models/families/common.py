"""What the families built on the Llama decoder share: building a model from published arguments, and the
``ModelFamily`` declaration itself."""

from __future__ import annotations

import dataclasses
from typing import Callable, Mapping, Optional

from torch import nn

from torchtune_ac.errors import UserError
from torchtune_ac.models.family import ModelFamily
from torchtune_ac.models.hf_adapter import LlamaStyleHFAdapter
from torchtune_ac.models.llama import Llama, LlamaArgs


def build_published(
    model_class: type[Llama],
    name: str,
    base: LlamaArgs,
    *,
    attn_dropout: float,
    resid_dropout: float,
    max_seq_len: Optional[int],
) -> Llama:
    """``model_class`` with the published ``base`` arguments, the caller's dropout and (unless None)
    ``max_seq_len``, built on the current default device.

    Raises:
        UserError: an out-of-range value, naming the builder.
    """
    try:
        args = dataclasses.replace(
            base,
            attn_dropout=attn_dropout,
            resid_dropout=resid_dropout,
            max_seq_len=base.max_seq_len if max_seq_len is None else max_seq_len,
        )
    except ValueError as e:
        raise UserError(f"model {name}: {e}") from None
    return model_class(args)


def llama_style_family(
    name: str,
    model_class: type[Llama],
    builders: Mapping[str, Callable[..., nn.Module]],
    hf: LlamaStyleHFAdapter,
) -> ModelFamily:
    """The family declaration of a model class built on the Llama decoder: its arguments are ``model.args``,
    its blocks ``model.layers``, and it initialises itself with ``init_weights()``."""
    return ModelFamily(
        name=name,
        model_class=model_class,
        builders=dict(builders),
        hf=hf,
        args_of=lambda model: model.args,
        build=model_class,
        blocks=lambda model: model.layers,
        init_weights=lambda model: model.init_weights(),
    )
