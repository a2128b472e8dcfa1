"""Expert parallelism in the simulated step (``simulate_expert_parallel``): each MoE layer holds one process's share
of its experts, and its rows go through the all-to-alls of ``parallel/expert_parallel.py``, their split assumed.

The all-to-alls are torch's functional collectives (a run sends its rows by ``all_to_all_rows``, an op that needs a
process group; the buffers are the same), which run on fake tensors without a process group: the simulation
allocates their buffers (each direction, forward and backward) and per-op AC saves their outputs as
in a run. What a fake tensor cannot know is how many rows the router sends to this process's experts: a balanced
router sends it as many as it routed (``T * k``); the simulation receives ``ROUTED_ROWS_MARGIN`` times that
(``Workload.routed_rows_margin``), which every tensor of its experts' compute is sized by.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from torchtune_ac.models.moe import MoE
from torchtune_ac.parallel.expert_parallel import ExpertAllToAll

# The all-to-alls' group, by name: the functional collectives on fake tensors never look it up.
_SIMULATED_GROUP = "planner_expert_parallel"


def _exchange(rows: torch.Tensor, output_splits: list[int], input_splits: list[int]) -> torch.Tensor:
    out = torch.ops._c10d_functional.all_to_all_single(rows, output_splits, input_splits, _SIMULATED_GROUP)
    return torch.ops._c10d_functional.wait_tensor(out)


def _split(total: int, parts: int) -> list[int]:
    """``total`` rows in ``parts`` splits as even as whole rows allow."""
    return [total // parts + (i < total % parts) for i in range(parts)]


class SimulatedExpertExchange(ExpertAllToAll):
    """``ExpertAllToAll`` (``parallel/expert_parallel.py``) itself on fake tensors, with the rows' split assumed:
    this process sends its ``N`` routed rows evenly to the ``degree`` processes and receives ``ceil(margin * N)``.

    Args:
        degree: the expert-parallel degree.
        margin: the rows this process's experts receive, as a multiple of a balanced router's (``N``).
    """

    def __init__(self, degree: int, margin: float) -> None:
        super().__init__(group=None, degree=degree)
        self.margin = margin

    def exchange_counts(self, counts: torch.Tensor) -> torch.Tensor:
        local = counts.numel() // self.degree
        return _exchange(counts, [local] * self.degree, [local] * self.degree)

    def splits(self, rows: torch.Tensor, counts: torch.Tensor, received: torch.Tensor) -> tuple[list[int], list[int]]:
        sent = rows.shape[0]
        return _split(math.ceil(self.margin * sent), self.degree), _split(sent, self.degree)

    def send(self, rows: torch.Tensor, splits: tuple[list[int], list[int]]) -> torch.Tensor:
        received, sent = splits
        return _exchange(rows, received, sent)

    def send_back(self, rows: torch.Tensor, splits: tuple[list[int], list[int]], output_rows: int) -> torch.Tensor:
        received, sent = splits
        return _exchange(rows, sent, received)


def simulate_expert_parallel(model: nn.Module, degree: int, margin: float) -> list[nn.Parameter]:
    """Give every MoE layer of ``model`` (built under fake tensors) one process's ``E / degree`` experts and the
    simulated exchange, in place, as ``apply_expert_parallel`` splits a run's; returns the experts' parameters (a
    process's share of them is sharded by FSDP2 over ``expert_shard`` processes, not ``shard``)."""
    params = []
    for module in model.modules():
        if not isinstance(module, MoE):
            continue
        experts = module.experts
        for name, param in list(experts.named_parameters(recurse=False)):
            local = torch.empty(param.shape[0] // degree, *param.shape[1:], dtype=param.dtype, device=param.device)
            experts.register_parameter(name, nn.Parameter(local, requires_grad=param.requires_grad))
            params.append(getattr(experts, name))
        experts.exchange = SimulatedExpertExchange(degree, margin)
    return params
