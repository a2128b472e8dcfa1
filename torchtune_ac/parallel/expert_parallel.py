"""Expert parallelism (``expert_parallel_dim``): each mixture-of-experts layer's experts split over the mesh's
``ep`` dimension, each token sent to its experts' process and back by an all-to-all.

    route -> dispatch (sort by expert) -> all-to-all -> compute_experts (local) -> all-to-all back -> combine

Each process of an expert-parallel group reads its own batch and routes its own tokens (``models/moe.py``). The
copies it sorted by expert go, in one all-to-all, to the processes that hold those experts: process ``r`` holds
experts ``[r * E/N, (r + 1) * E/N)``. Each process runs its experts over every row it received, in one grouped
matmul, and a second all-to-all returns the results to the processes their tokens came from, which weigh and sum
them as without parallelism. Routing stays dropless: the all-to-alls' splits are the counts the router made, so
no token is dropped or padded (the splits are read on the host, one synchronisation a layer and forward).

The experts' weights become DTensors sharded on their leading (expert) dimension over ``ep``; FSDP2 then shards
each process's experts over the processes that hold the same ones (``parallel/fsdp.py``) and scales their
gradients as the dense layers' (each expert's gradient sums the contributions of every process of the group).
A checkpoint holds the whole tensors, whatever the layout (DCP and Hugging Face files alike).

Backward sends the gradients of the rows back along the same routes (the all-to-alls' autograd form). Per-op
activation checkpointing saves both all-to-alls' outputs (``activation_checkpointing/mechanism.py``), so a
recomputed block does not send its tokens again; full AC keeps them too (``save_collectives``). The memory
planner simulates this exchange op for op on fake tensors (``memory/planner/experts.py``).
"""

from __future__ import annotations

import torch
import torch.distributed._functional_collectives as funcol
from torch import nn
from torch.distributed import ProcessGroup
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Shard, distribute_tensor

from torchtune_ac.models.moe import Dispatch, GroupedExperts, MoE, compute_arrived_experts


class ExpertAllToAll:
    """The exchange a ``GroupedExperts`` runs instead of computing every expert (its ``exchange``): its rows to
    their experts' processes, its local experts over what it received, the results back.

    The memory planner runs this same exchange on fake tensors (``memory/planner/experts.py``), with its two
    methods that touch the processes replaced: ``exchange_counts`` and ``splits``.

    Args:
        group: the expert-parallel group (the mesh's ``ep`` dimension).
        degree: its size, which divides the layer's experts.
    """

    def __init__(self, group: ProcessGroup, degree: int) -> None:
        self.group = group
        self.degree = degree

    @torch.compiler.disable
    def __call__(self, experts: GroupedExperts, rows: torch.Tensor, plan: Dispatch) -> torch.Tensor:
        """``rows [N, dim]`` sorted by (global) expert, ``plan`` their counts -> each row's expert output ``[N, dim]``,
        in the same order. Kept out of compiled graphs: the splits are data."""
        local = plan.counts.numel() // self.degree
        # received[r, j]: the rows process r sends to this process's expert j.
        received = self.exchange_counts(plan.counts).view(self.degree, local)
        send_splits, receive_splits = self.splits(rows, plan.counts, received)
        arrived = self.all_to_all(rows, receive_splits, send_splits)  # by source process, then by expert
        out = compute_arrived_experts(experts, arrived, received)  # in arrival order
        return self.all_to_all(out, send_splits, receive_splits)

    def exchange_counts(self, counts: torch.Tensor) -> torch.Tensor:
        """Each process's count for each expert, to the expert's process: ``[E]`` -> ``[degree * E / degree]``."""
        return funcol.all_to_all_single(counts, None, None, self.group)

    def splits(self, rows: torch.Tensor, counts: torch.Tensor, received: torch.Tensor) -> tuple[list[int], list[int]]:
        """The rows this process sends to each process, and receives from each, from its experts' ``counts [E]``
        and ``received [degree, E / degree]`` (read on the host: one synchronisation for both directions)."""
        sent = counts.view(self.degree, -1).sum(dim=1)
        splits = torch.cat([sent, received.sum(dim=1)]).tolist()
        return splits[:self.degree], splits[self.degree:]

    def all_to_all(self, rows: torch.Tensor, output_splits: list[int], input_splits: list[int]) -> torch.Tensor:
        """``rows`` split by ``input_splits`` to the group's processes, ``output_splits`` of theirs received, with
        the gradients sent back in backward."""
        return funcol.all_to_all_single_autograd(rows, output_splits, input_splits, self.group)


def apply_expert_parallel(model: nn.Module, ep_mesh: DeviceMesh) -> None:
    """Split every mixture-of-experts layer of ``model`` over ``ep_mesh`` (the run mesh's ``ep`` dimension), in
    place: its experts' weights become DTensors sharded on the expert dimension, and the layer exchanges its rows
    with an all-to-all (``ExpertAllToAll``).

    Call on the meta-device model, after activation checkpointing and compile, before FSDP2 (the run's plan
    checked that the degree divides the experts).
    """
    exchange = ExpertAllToAll(ep_mesh.get_group(), ep_mesh.size())
    for module in model.modules():
        if not isinstance(module, MoE):
            continue
        experts = module.experts
        for name, param in list(experts.named_parameters(recurse=False)):
            # src_data_rank=None: each process takes its own chunk, nothing is sent (the weights are loaded later).
            split = distribute_tensor(param.data, ep_mesh, [Shard(0)], src_data_rank=None)
            experts.register_parameter(name, nn.Parameter(split, requires_grad=param.requires_grad))
        experts.exchange = exchange


def busiest_rank_load(expert_tokens: list[list[float]], degree: int) -> list[float]:
    """Per MoE layer, the rows the busiest process of an expert-parallel group received against the group's mean
    (1.0: balanced; the planner assumes ``ROUTED_ROWS_MARGIN``), from ``moe_expert_tokens`` (each layer's rows per
    expert, summed over a step): process ``r`` holds experts ``[r * E/degree, (r + 1) * E/degree)``."""
    loads = []
    for layer in expert_tokens:
        per_rank = torch.tensor(layer, dtype=torch.float64).view(degree, -1).sum(dim=1)
        mean = float(per_rank.mean())
        loads.append(round(float(per_rank.max()) / mean, 4) if mean > 0 else 1.0)
    return loads
