"""DPO's reference when the policy has adapters: the policy itself with its adapters off (``adapters_off``), as TRL
does with a PEFT model; no second model is built or kept."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping

import torch
from torch import nn

from torchtune_ac.lora.mechanism import adapters_off
from torchtune_ac.training.dpo import DPO_METRICS, DPOObjective, reference_logps
from torchtune_ac.training.objective import LossParts


@dataclass(frozen=True)
class BaseAsReference:
    """The DPO objective (``training/dpo.py``) whose reference log-probabilities come from the policy's base: each
    micro-batch's are computed first, under ``no_grad`` with the adapters off, then handed to ``dpo`` as a
    precomputed reference's would be.

    Attributes:
        dpo: the DPO objective, without a reference model.
    """

    dpo: DPOObjective
    metric_names = DPO_METRICS

    @property
    def loss_scale(self) -> tuple[str, float]:
        return self.dpo.loss_scale

    def targets(self, batch: Mapping[str, torch.Tensor]) -> torch.Tensor:
        return self.dpo.targets(batch)

    def __call__(self, model: nn.Module, batch: Mapping[str, torch.Tensor]) -> LossParts:
        with adapters_off(model):
            reference = reference_logps(model, batch, self.dpo.n_chunks)  # [2p]
        return self.dpo(model, {**batch, "reference_logps": reference})
