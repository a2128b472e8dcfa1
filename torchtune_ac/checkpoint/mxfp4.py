"""MXFP4, the format of gpt-oss's published expert weights: dequantised exactly on load.

A weight ``[E, rows, cols]`` is stored as ``*_blocks [E, rows, cols / 32, 16]`` uint8 (32 four-bit e2m1 values per
block, two per byte, the low nibble first) and ``*_scales [E, rows, cols / 32]`` uint8 (each block's power of two,
biased by 127). Every value is one of +-{0, 0.5, 1, 1.5, 2, 3, 4, 6} times that power: a float32, and a bfloat16
where the power is within its range, exactly. The weight is then held transposed, ``[E, cols, rows]`` (the
``[E, in, out]`` layout transformers dequantises into).
"""

from __future__ import annotations

import torch

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
