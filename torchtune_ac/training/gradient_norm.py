"""The total norm of a model's gradients over the run's processes, measured one way for both steppers (after
backward, ``step.py``'s; in backward, ``memory/optimizer_in_backward.py``'s): this rank's squared norms of its
pieces of each gradient, summed over the processes whose pieces differ, as the run's mesh says
(``runtime/parallelism.py``'s ``gradient_groups``), never over copies.
"""

from __future__ import annotations

from typing import Iterable, Optional

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from torchtune_ac.runtime.parallelism import TP_DIM, GradientGroups, gradient_groups


class GradientNorm:
    """Measures the total norm of ``parameters``' gradients over the run's processes.

    Each rank measures its pieces in float32, in two parts: the parameters tensor parallelism did not split (their
    pieces differ over ``shard``) and those it split (over ``shard`` x ``tp``); ``total`` sums each part's squares
    over its group. Nothing here waits for the device.

    Args:
        parameters: the parameters whose gradients are measured (the sharded ones after ``fully_shard``).
        mesh: the run's device mesh (``Parallelism.build_mesh``); None: the mesh the parameters are sharded over (a
            model sharded outside a run), or one process of plain tensors.
    """

    def __init__(self, parameters: Iterable[torch.Tensor], mesh: Optional[DeviceMesh] = None) -> None:
        params = list(parameters)
        if mesh is None:
            sharded = next((p for p in params if isinstance(p, DTensor)), None)
            mesh = None if sharded is None else sharded.device_mesh._get_root_mesh()
        self.groups: Optional[GradientGroups] = None if mesh is None else gradient_groups(mesh)
        self._split_over_tp = {id(p) for p in params if _split_over_tp(p)}

    def part_of(self, param: torch.Tensor) -> int:
        """Which part ``param``'s squared norm joins: 0, summed over ``shard``; 1 (split by tensor parallelism),
        over ``shard`` x ``tp``."""
        return int(id(param) in self._split_over_tp)

    def local_norms(self, parameters: Iterable[torch.Tensor]) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """The float32 norms of this rank's pieces of the gradients of ``parameters`` (those that have one), by
        part (``part_of``)."""
        parts: tuple[list[torch.Tensor], list[torch.Tensor]] = ([], [])
        for param in parameters:
            grad = param.grad
            if grad is not None:
                parts[self.part_of(param)].append(grad.to_local() if isinstance(grad, DTensor) else grad)
        # Reductions in float32, not float32 copies of the gradients (those would double their memory).
        return tuple(list(torch._foreach_norm(grads, 2.0, dtype=torch.float32)) if grads else [] for grads in parts)

    def total(self, norms: tuple[list[torch.Tensor], list[torch.Tensor]]) -> torch.Tensor:
        """The total norm (a 0-d float32 tensor) of the gradients whose pieces' norms every rank holds, by part
        (``local_norms``; the step in backward collects them one parameter at a time): each part's squares summed
        over its group (one all-reduce per group, ``GradientGroups``). Every rank calls this.
        """
        groups = self.groups
        first = next((part[0] for part in norms if part), None)
        if groups is not None:
            device = torch.device(groups.device_type)
        else:
            device = first.device if first is not None else torch.device("cpu")
        squares = [torch.linalg.vector_norm(torch.stack(part)).square().to(device) if part
                   else torch.zeros((), device=device) for part in norms]
        if groups is not None:
            for square, group in zip(squares, (groups.shard, groups.shard_tp)):
                if group is not None:
                    dist.all_reduce(square, op=dist.ReduceOp.SUM, group=group)
        return (squares[0] + squares[1]).sqrt()

    def clip_(self, parameters: Iterable[torch.Tensor], max_norm: Optional[float]) -> torch.Tensor:
        """Measure the gradients of ``parameters`` and scale them so that their total norm is at most ``max_norm``
        (None: only measure), in place, every piece by the same coefficient (as torch's ``clip_grads_with_norm_``).

        Returns:
            The total norm before clipping.
        """
        params = [p for p in parameters if p.grad is not None]
        norm = self.total(self.local_norms(params))
        if max_norm is not None and params:
            grads = [p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad for p in params]
            coefficient = (max_norm / (norm + 1e-6)).clamp(max=1.0)
            torch._foreach_mul_(grads, coefficient.to(grads[0].device))
        return norm


def _split_over_tp(param: torch.Tensor) -> bool:
    """Whether tensor parallelism split ``param`` (its pieces differ over the mesh's ``tp`` dimension)."""
    if not isinstance(param, DTensor):
        return False
    names = param.device_mesh.mesh_dim_names or ()
    return TP_DIM in names and not param.placements[names.index(TP_DIM)].is_replicate()
