"""The floating-point dtypes a run can store and compute in, by their config names."""

from __future__ import annotations

import enum

import torch


class DType(str, enum.Enum):
    """``fp32`` or ``bf16`` in a config; ``.torch`` is the ``torch.dtype``."""

    FP32 = "fp32"
    BF16 = "bf16"

    @property
    def torch(self) -> torch.dtype:
        return {DType.FP32: torch.float32, DType.BF16: torch.bfloat16}[self]
