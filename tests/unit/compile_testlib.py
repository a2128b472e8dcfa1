"""What the compile tests share: a model's blocks compiled or not, with Dynamo's counters fresh, and what Dynamo
then counted (graphs made, graph breaks)."""

from __future__ import annotations

import torch
from torch import nn
from torch._dynamo.utils import counters

from torchtune_ac.models.families import transformer_blocks


def compile_blocks_counted(model: nn.Module, compiled: bool) -> None:
    """Reset Dynamo and its counters, then compile each transformer block in place when ``compiled`` (backend
    ``aot_eager``: Dynamo's graphs and AOT autograd, as inductor gets them, without its code generation)."""
    torch._dynamo.reset()
    counters.clear()
    if compiled:
        for block in transformer_blocks(model):
            block.compile(backend="aot_eager")


def graphs_and_breaks() -> tuple[int, dict[str, int]]:
    """The graphs Dynamo made since ``compile_blocks_counted`` and its graph breaks by reason."""
    return counters["stats"]["unique_graphs"], dict(counters["graph_break"])
