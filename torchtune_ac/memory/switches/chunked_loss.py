"""The chunked loss as a memory switch: the output projection and cross-entropy a chunk of targets at a time,
never the whole logits (mechanism: ``memory/chunked_loss.py``).

    loss_chunks: null | N              # N > 1: project and score the targets N chunks at a time

``loss_chunks: null`` (the default) chooses from the vocabulary: ``DEFAULT_LOSS_CHUNKS`` chunks when it has at
least ``CHUNKED_LOSS_MIN_VOCAB`` tokens (the logits then outweigh everything else a step keeps), else the
whole logits (see the README's "Fitting a bigger model" for the measurements behind this).
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field
from typing import Optional

from torch import nn

from torchtune_ac.errors import UserError
from torchtune_ac.memory.chunked_loss import ChunkedCrossEntropyObjective
from torchtune_ac.memory.switch import Alternative, SwitchContext, SwitchDefaults

DEFAULT_LOSS_CHUNKS = 8
CHUNKED_LOSS_MIN_VOCAB = 32_000


@dataclass(frozen=True)
class ChunkedLossConfig:
    # Chunks of the output projection + cross-entropy; null: DEFAULT_LOSS_CHUNKS for large vocabularies, else 1.
    loss_chunks: Optional[int] = field(default=None, metadata={"minimum": 1})


def takes_output_head(model: nn.Module) -> bool:
    """Whether the model's forward accepts ``head=`` (the chunked loss runs through it)."""
    return "head" in inspect.signature(model.forward).parameters


class ChunkedLossSwitch(SwitchDefaults):
    name = "loss_chunks"
    label = "loss"
    off = 1
    order = 20
    config_class = ChunkedLossConfig

    def resolve(self, config: ChunkedLossConfig, ctx: SwitchContext) -> int:
        chunks = config.loss_chunks
        if chunks is None:
            large = ctx.vocab_size is not None and ctx.vocab_size >= CHUNKED_LOSS_MIN_VOCAB
            chunks = DEFAULT_LOSS_CHUNKS if large else 1
        if chunks > 1 and not takes_output_head(ctx.model):
            raise UserError(
                f"loss_chunks={chunks}: the chunked loss runs through the model's output head, and "
                f"{type(ctx.model).__name__}.forward takes no `head` argument; set loss_chunks: 1"
            )
        return chunks

    def describe(self, setting: int, vocab_size: Optional[int]) -> str:
        vocab = f" (vocabulary {vocab_size:,})" if vocab_size else ""
        if setting > 1:
            return (f"{setting} chunks{vocab}: targets only, each chunk's gradients computed as it goes (nothing "
                    "recomputed in backward), never the whole logits")
        return f"whole logits{vocab}"

    def objective(self, setting: int) -> Optional[ChunkedCrossEntropyObjective]:
        return ChunkedCrossEntropyObjective(setting) if setting > 1 else None

    def alternatives(self, setting: int) -> list[Alternative]:
        return [Alternative(f"loss_chunks={DEFAULT_LOSS_CHUNKS}", DEFAULT_LOSS_CHUNKS)] if setting == 1 else []


SWITCH = ChunkedLossSwitch()
