"""Expert parallelism in the simulated step (``simulate_expert_parallel``): each MoE layer holds one process's share
of its experts, and its rows go through the all-to-alls of ``parallel/expert_parallel.py``, their split assumed.

The all-to-alls are torch's functional collectives themselves, which run on fake tensors without a process group:
the simulation allocates their buffers (each direction, forward and backward) and per-op AC saves their outputs as
in a run. What a fake tensor cannot know is how many rows the router sends to this process's experts: a balanced
router sends it as many as it routed (``T * k``); the simulation receives ``ROUTED_ROWS_MARGIN`` times that
(``Workload.routed_rows_margin``), which every tensor of its experts' compute is sized by.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from torchtune_ac.models.moe import Dispatch, GroupedExperts, MoE, compute_experts, inverse_permutation

# The all-to-alls' group, by name: the functional collectives on fake tensors never look it up.
_SIMULATED_GROUP = "planner_expert_parallel"


def _exchange(rows: torch.Tensor, output_splits: list[int], input_splits: list[int]) -> torch.Tensor:
    out = torch.ops._c10d_functional.all_to_all_single(rows, output_splits, input_splits, _SIMULATED_GROUP)
    return torch.ops._c10d_functional.wait_tensor(out)


def _split(total: int, parts: int) -> list[int]:
    """``total`` rows in ``parts`` splits as even as whole rows allow."""
    return [total // parts + (i < total % parts) for i in range(parts)]


class SimulatedExpertExchange:
    """``ExpertAllToAll`` (``parallel/expert_parallel.py``) op for op on fake tensors, with the rows' split assumed:
    this process sends its ``N`` routed rows evenly to the ``degree`` processes and receives ``ceil(margin * N)``.

    Args:
        degree: the expert-parallel degree.
        margin: the rows this process's experts receive, as a multiple of a balanced router's (``N``).
    """

    def __init__(self, degree: int, margin: float) -> None:
        self.degree = degree
        self.margin = margin

    def __call__(self, experts: GroupedExperts, rows: torch.Tensor, plan: Dispatch) -> torch.Tensor:
        degree, sent = self.degree, rows.shape[0]
        local = plan.counts.numel() // degree
        received = math.ceil(self.margin * sent)
        send_splits, receive_splits = _split(sent, degree), _split(received, degree)
        counts = _exchange(plan.counts, [local] * degree, [local] * degree).view(degree, local)
        arrived = _exchange(rows, receive_splits, send_splits)  # [received, dim]
        expert_ids = torch.arange(local, device=rows.device).repeat(degree)
        ids = torch.repeat_interleave(expert_ids, counts.flatten(), output_size=received)
        order = torch.argsort(ids, stable=True)
        local_plan = Dispatch(order=order, experts=ids[order], counts=counts.sum(dim=0))
        out = compute_experts(experts, arrived[order], local_plan)
        unsorted = out[inverse_permutation(order)]
        return _exchange(unsorted, send_splits, receive_splits)  # [sent, dim]


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
