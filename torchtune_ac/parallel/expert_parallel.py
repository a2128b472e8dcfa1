"""Expert parallelism (``expert_parallel_dim``): each mixture-of-experts layer's experts split over the mesh's
``ep`` dimension, each token sent to its experts' process and back by an all-to-all.

    route -> dispatch (sort by expert) -> all-to-all -> compute_experts (local) -> all-to-all back -> combine

Each process of an expert-parallel group reads its own batch and routes its own tokens (``models/moe.py``). The
copies it sorted by expert go, in one all-to-all, to the processes that hold those experts: process ``r`` holds
experts ``[r * E/N, (r + 1) * E/N)``. Each process runs its experts over every row it received, in one grouped
matmul, and a second all-to-all returns the results to the processes their tokens came from, which weigh and sum
them as without parallelism. Routing stays dropless: the all-to-alls' splits are the counts the router made, so
no token is dropped or padded (the splits are copied to the host, one synchronisation a layer and forward).

The experts' weights become DTensors sharded on their leading (expert) dimension over ``ep``; FSDP2 then shards
each process's experts over the processes that hold the same ones (``parallel/fsdp.py``) and scales their
gradients as the dense layers' (each expert's gradient sums the contributions of every process of the group).
A checkpoint holds the whole tensors, whatever the layout (DCP and Hugging Face files alike).

The rows' all-to-all is an op of ours (``all_to_all_rows``, with a shape function and a backward), so that a
compiled block traces the whole exchange in its graph (no graph break, under any AC mode).

Backward sends the gradients of the rows back along the same routes (the op's autograd formula). Per-op
activation checkpointing saves both all-to-alls' outputs (``activation_checkpointing/mechanism.py``), so a
recomputed block does not send its tokens again; full AC keeps them too (``save_collectives``). The memory
planner simulates this exchange op for op on fake tensors (``memory/planner/experts.py``).
"""

from __future__ import annotations

from typing import Any, Optional

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch import nn
from torch.distributed import ProcessGroup
from torch.distributed.distributed_c10d import _resolve_process_group
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Shard, distribute_tensor

from torchtune_ac.models.moe import Dispatch, GroupedExperts, MoE, compute_arrived_experts


@torch.library.custom_op("torchtune_ac::all_to_all_rows", mutates_args=())
def all_to_all_rows(rows: torch.Tensor, splits: torch.Tensor, group_name: str,
                    output_rows: Optional[int] = None) -> torch.Tensor:
    """``rows [N, ...]`` to the group's processes: ``splits [2, degree]`` (in host memory) holds the rows received
    from each process (row 0) and sent to each (row 1), read here, so that a compiled graph holds no host read.
    ``output_rows``: their sum where the caller knows it (the way back), else a size only the data tells (which
    ``torch.compile`` traces as an unbacked size). Backward sends the gradients back the other way."""
    received, sent = splits.tolist()
    out = rows.new_empty(sum(received), *rows.shape[1:])
    dist.all_to_all_single(out, rows.contiguous(), received, sent, group=_resolve_process_group(group_name))
    return out


@all_to_all_rows.register_fake
def _all_to_all_rows_shape(rows: torch.Tensor, splits: torch.Tensor, group_name: str,
                           output_rows: Optional[int] = None) -> torch.Tensor:
    if output_rows is None:
        output_rows = torch.library.get_ctx().new_dynamic_size()
    return rows.new_empty(output_rows, *rows.shape[1:])


def _all_to_all_rows_setup(ctx: Any, inputs: tuple, output: torch.Tensor) -> None:
    rows, splits, group_name, _ = inputs
    ctx.save_for_backward(splits)
    ctx.group_name, ctx.input_rows = group_name, rows.shape[0]


def _all_to_all_rows_backward(ctx: Any, grad: torch.Tensor) -> tuple:
    (splits,) = ctx.saved_tensors
    return all_to_all_rows(grad, splits.flip(0), ctx.group_name, ctx.input_rows), None, None, None


all_to_all_rows.register_autograd(_all_to_all_rows_backward, setup_context=_all_to_all_rows_setup)


class ExpertAllToAll:
    """The exchange a ``GroupedExperts`` runs instead of computing every expert (its ``exchange``): its rows to
    their experts' processes, its local experts over what it received, the results back.

    Traceable by ``torch.compile`` (no graph break): the counts go by a functional all-to-all, the rows by
    ``all_to_all_rows``, which reads their splits inside the op. The memory planner runs this same
    exchange on fake tensors (``memory/planner/experts.py``), with its methods that touch the processes replaced:
    ``exchange_counts``, ``splits``, ``send`` and ``send_back``.

    Args:
        group: the expert-parallel group (the mesh's ``ep`` dimension).
        degree: its size, which divides the layer's experts.
    """

    def __init__(self, group: Optional[ProcessGroup], degree: int) -> None:
        self.group_name = group.group_name if group is not None else ""
        self.degree = degree

    def __call__(self, experts: GroupedExperts, rows: torch.Tensor, plan: Dispatch) -> torch.Tensor:
        """``rows [N, dim]`` sorted by (global) expert, ``plan`` their counts -> each row's expert output ``[N, dim]``,
        in the same order."""
        local = plan.counts.numel() // self.degree
        # received[r, j]: the rows process r sends to this process's expert j.
        received = self.exchange_counts(plan.counts).view(self.degree, local)
        splits = self.splits(rows, plan.counts, received)
        arrived = self.send(rows, splits)  # by source process, then by expert
        out = compute_arrived_experts(experts, arrived, received)  # in arrival order
        return self.send_back(out, splits, rows.shape[0])

    def exchange_counts(self, counts: torch.Tensor) -> torch.Tensor:
        """Each process's count for each expert, to the expert's process: ``[E]`` -> ``[degree * E / degree]``."""
        return funcol.all_to_all_single(counts, None, None, self.group_name)

    def splits(self, rows: torch.Tensor, counts: torch.Tensor, received: torch.Tensor) -> Any:
        """``[2, degree]`` in host memory: the rows this process receives from each process and sends to each, from
        its experts' ``counts [E]`` and ``received [degree, E / degree]``. Copied to the host once (on a GPU, the
        layer's one synchronisation): both all-to-alls and their backward read this copy."""
        return torch.stack([received.sum(dim=1), counts.view(self.degree, -1).sum(dim=1)]).cpu()

    def send(self, rows: torch.Tensor, splits: Any) -> torch.Tensor:
        """This process's rows to their experts' processes; theirs received."""
        return all_to_all_rows(rows, splits, self.group_name)

    def send_back(self, rows: torch.Tensor, splits: Any, output_rows: int) -> torch.Tensor:
        """The experts' outputs back to the processes their rows came from (``output_rows`` of them here)."""
        return all_to_all_rows(rows, splits.flip(0), self.group_name, output_rows)


def apply_expert_parallel(model: nn.Module, ep_mesh: DeviceMesh) -> None:
    """Split every mixture-of-experts layer of ``model`` over ``ep_mesh`` (the run mesh's ``ep`` dimension), in
    place: its experts' weights become DTensors sharded on the expert dimension, and the layer exchanges its rows
    with an all-to-all (``ExpertAllToAll``).

    Call on the meta-device model, after activation checkpointing and compile, before FSDP2 (the run's plan
    checked that the degree divides the experts).
    """
    # The rows received are a number only the data tells: Dynamo traces ``all_to_all_rows`` with an unbacked size
    # instead of breaking the compiled block's graph there (a process-wide switch of torch's).
    torch._dynamo.config.capture_dynamic_output_shape_ops = True
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
