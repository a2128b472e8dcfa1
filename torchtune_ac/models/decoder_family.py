"""Declaring a family built on the Llama decoder (``models/llama.py``): its published builders and its
``ModelFamily``, from data.

A family module under ``models/families/`` holds the published ``LlamaArgs`` of each size, a
``LlamaStyleHFAdapter`` (or a subclass of it, where the family's config.json or names differ further) and, where
its block differs in structure, its own block class; ``decoder_family`` turns them into the family and its
builders.

Every builder has the same keyword-only signature (no ``**kwargs``: YAML configs instantiate builders by dotted
path, and the config system checks keys against the signature):

    attn_dropout:  dropout on attention probabilities (the published models use 0.0)
    resid_dropout: dropout on each residual branch (0.0)
    max_seq_len:   longest sequence the model is meant for; None keeps the published value

and raises ``UserError`` for an out-of-range value. Builders construct on the current default device: wrap a
call in ``with torch.device("meta"):`` to get shapes without allocating memory.
"""

import dataclasses
import functools
from typing import Callable, Mapping, Optional

import torch
from torch import nn

from torchtune_ac.component_marker import config_component
from torchtune_ac.errors import UserError
from torchtune_ac.models.family import ModelFamily, TorchtuneBuilder
from torchtune_ac.models.hf_adapter import LlamaStyleHFAdapter
from torchtune_ac.models.llama import BlockClass, Llama, LlamaArgs, TransformerBlock
from torchtune_ac.models.tensor_parallel import Split, TensorParallelPlan

# This module has no ``from __future__ import annotations``: the builders' annotations must be types, which the
# config system reads to check a YAML value against a builder's parameter.


def published_builder(
    module: str, name: str, base: LlamaArgs, doc: str, build: Callable[[LlamaArgs], Llama]
) -> Callable[..., Llama]:
    """A builder of the published model ``base``, marked as a config component.

    Args:
        module: the family module the builder is a name of (its ``__module__``).
        name: the builder's name (``llama3_8b``).
        base: the published arguments.
        doc: the builder's docstring (the model and its parameter count).
        build: the family's ``build``.
    """

    def builder(*, attn_dropout: float = 0.0, resid_dropout: float = 0.0, max_seq_len: int | None = None) -> Llama:
        try:
            args = dataclasses.replace(
                base,
                attn_dropout=attn_dropout,
                resid_dropout=resid_dropout,
                max_seq_len=base.max_seq_len if max_seq_len is None else max_seq_len,
            )
        except ValueError as e:
            raise UserError(f"model {name}: {e}") from None
        return build(args)

    builder.__module__, builder.__name__, builder.__qualname__, builder.__doc__ = module, name, name, doc
    return config_component(builder)


def decoder_family(
    module: str,
    name: str,
    hf: LlamaStyleHFAdapter,
    published: Mapping[str, tuple[LlamaArgs, str]],
    *,
    block: BlockClass = TransformerBlock,
    block_splits: Optional[Mapping[str, Split]] = None,
    tensor_parallel: bool = True,
    torchtune_builders: Optional[Mapping[str, TorchtuneBuilder]] = None,
    torchtune_packages: tuple[str, ...] = (),
) -> ModelFamily:
    """The ``ModelFamily`` of a family built on the Llama decoder: its arguments are ``model.args``, its blocks
    ``model.layers``, its shard groups the embeddings and ``[norm, output]`` (none when the two share their
    weight), and it initialises itself with ``init_weights()``.

    Args:
        module: the family module (``__name__``), where its builders are defined.
        name: the family's short name (``qwen2``).
        hf: its Hugging Face adapter.
        published: builder name -> (published arguments, docstring).
        block: its block class, where it differs in structure from ``TransformerBlock``.
        block_splits: how the modules its block adds to ``TransformerBlock``'s run under tensor parallelism
            (``models/tensor_parallel.py``), beside ``TransformerBlock``'s own (``decoder_tensor_parallel_plan``).
        tensor_parallel: whether its models can be split by tensor parallelism (not a mixture of experts, whose
            experts are no ``TransformerBlock`` MLP).
        torchtune_builders: the torchtune builders its builders replace (``tune migrate``).
        torchtune_packages: the torchtune model packages of its architecture (``tune migrate``).

    Raises:
        ValueError: published arguments that are not of this family.
    """

    def build(args: LlamaArgs) -> Llama:
        hf.check_args(args)
        return Llama(args, block)

    for builder_name, (args, _) in published.items():
        try:
            hf.check_args(args)
        except ValueError as e:
            raise ValueError(f"{module}: {builder_name}: {e}") from None
    return ModelFamily(
        name=name,
        model_class=Llama,
        builders={n: published_builder(module, n, args, doc, build) for n, (args, doc) in published.items()},
        hf=hf,
        args_of=_args_of,
        build=build,
        blocks=_blocks,
        shard_groups=decoder_shard_groups,
        init_weights=_init_weights,
        init_parameter=_init_parameter,
        tensor_parallel_plan=(functools.partial(decoder_tensor_parallel_plan, block_splits=dict(block_splits or {}))
                              if tensor_parallel else None),
        torchtune_builders=dict(torchtune_builders or {}),
        torchtune_packages=torchtune_packages,
    )


def _args_of(model: nn.Module) -> LlamaArgs:
    return model.args


def _blocks(model: nn.Module) -> nn.ModuleList:
    return model.layers


def decoder_shard_groups(model: nn.Module) -> tuple[tuple[nn.Module, ...], ...]:
    """``ModelFamily.shard_groups`` of a model on the Llama decoder: the embedding, then ``[norm, output]``."""
    # torchtitan's grouping: the embedding is gathered just before the first block, and [norm, output] just
    # before the head. A tied output is the embedding's weight, used first and last: it stays with the root.
    if model.args.tie_embeddings:
        return ()
    return (model.tok_embeddings,), (model.norm, model.output)


# The decoder's plan: the residual stream, and the norms on it, hold a slice of the sequence; attention and the MLP
# hold a slice of the heads and columns (see ``models/tensor_parallel.py``).
_DECODER_ROOT = {"tok_embeddings": Split.VOCAB_EMBEDDING, "norm": Split.SEQUENCE, "output": Split.VOCAB_OUTPUT}
_DECODER_BLOCK = {
    "attn_norm": Split.SEQUENCE,
    "attn": Split.GATHER,
    "attn.q_proj": Split.COLUMN,
    "attn.k_proj": Split.COLUMN,
    "attn.v_proj": Split.COLUMN,
    "attn.o_proj": Split.ROW,
    "mlp_norm": Split.SEQUENCE,
    "mlp": Split.GATHER,
    "mlp.gate_proj": Split.COLUMN,
    "mlp.up_proj": Split.COLUMN,
    "mlp.down_proj": Split.ROW,
}
# Qwen3's and Gemma 3's q/k norms scale each head by one weight of head_dim: on this rank's heads.
_QK_NORMS = {"attn.q_norm": Split.HEADS, "attn.k_norm": Split.HEADS}


def decoder_tensor_parallel_plan(args: LlamaArgs, block_splits: Mapping[str, Split] = {}) -> TensorParallelPlan:
    """The tensor-parallel plan of a model on the Llama decoder: ``TransformerBlock``'s splits, its q/k norms' where
    it has them, and ``block_splits`` for what a family's block adds (Gemma 3's post-norms)."""
    block = {**_DECODER_BLOCK, **(_QK_NORMS if args.qk_norm else {}), **block_splits}
    return TensorParallelPlan(
        root=_DECODER_ROOT,
        block=block,
        divisible={"n_heads": args.n_heads, "n_kv_heads": args.n_kv_heads, "intermediate_dim": args.intermediate_dim},
    )


def _init_weights(model: nn.Module) -> None:
    model.init_weights()


def _init_parameter(model: nn.Module, name: str, tensor: torch.Tensor, generator: torch.Generator) -> None:
    model.init_parameter_(name, tensor, generator)
