"""MXFP4, the format of gpt-oss's published expert weights: a ``Decoder`` (``checkpoint/layout.py``) that
dequantises them exactly on load.

A weight ``[E, rows, cols]`` is stored as ``*_blocks [E, rows, cols / 32, 16]`` uint8 (32 four-bit e2m1 values per
block, two per byte, the low nibble first) and ``*_scales [E, rows, cols / 32]`` uint8 (each block's power of two,
biased by 127). Every value is one of +-{0, 0.5, 1, 1.5, 2, 3, 4, 6} times that power: a float32, and a bfloat16
where the power is within its range, exactly. The weight is then held transposed, ``[E, cols, rows]`` (the
``[E, in, out]`` layout transformers dequantises into).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional, Sequence

import torch

from torchtune_ac.checkpoint.layout import Region, Shape, StoredTensor

# The sixteen e2m1 values, by their four bits.
_E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
BLOCK = 32


def dequantized_shape(blocks_shape: tuple[int, ...]) -> tuple[int, ...]:
    """The weight's shape ``[E, cols, rows]`` for blocks of shape ``[E, rows, cols / 32, 16]``."""
    experts, rows, groups, _ = blocks_shape
    return (experts, groups * BLOCK, rows)


def dequantize_mxfp4(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """``blocks [E, rows, G, 16]`` and ``scales [E, rows, G]`` (uint8) -> the weight ``[E, G * 32, rows]``, float32."""
    table = torch.tensor(_E2M1, dtype=torch.float32)
    low, high = table[(blocks & 0x0F).long()], table[(blocks >> 4).long()]  # [E, rows, G, 16] each
    values = torch.stack((low, high), dim=-1).flatten(-2)  # [E, rows, G, 32]: low nibble first
    values = torch.ldexp(values, (scales.to(torch.int32) - 127).unsqueeze(-1).float())
    return values.flatten(-2).transpose(1, 2)  # [E, G * 32, rows]


@dataclass(frozen=True)
class Mxfp4Decoder:
    """A weight ``name`` stored as ``name_blocks`` and ``name_scales``."""

    name: str = "MXFP4"

    def sources(self, stored: str) -> tuple[str, ...]:
        return f"{stored}_blocks", f"{stored}_scales"

    def decoded_shape(self, sources: Sequence[StoredTensor]) -> tuple[Optional[Shape], list[str]]:
        blocks, scales = sources
        problems = [f"{t.file.name}: {t.name} has dtype {t.dtype}, expected U8 (MXFP4)"
                    for t in (blocks, scales) if t.dtype != "U8"]
        if len(blocks.shape) != 4 or blocks.shape[3] != 16 or scales.shape != blocks.shape[:3]:
            problems.append(f"{blocks.file.name}: {blocks.name} {list(blocks.shape)} and {scales.name} "
                            f"{list(scales.shape)} are not MXFP4 blocks [E, rows, groups, 16] and scales "
                            "[E, rows, groups]")
            return None, problems
        return dequantized_shape(blocks.shape), problems

    def read(self, stored: str, region: Region, read: Callable[[str, Region], torch.Tensor]) -> torch.Tensor:
        experts, cols, rows = region  # of the weight [E, cols, rows]: every column group of these rows is read
        blocks_name, scales_name = self.sources(stored)
        blocks = read(blocks_name, (experts, rows, slice(None), slice(None)))
        scales = read(scales_name, (experts, rows, slice(None)))
        return dequantize_mxfp4(blocks, scales)[:, cols]


MXFP4 = Mxfp4Decoder()
