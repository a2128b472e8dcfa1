"""Tensor and sequence parallelism: a family's plan (``models/tensor_parallel.py``) applied with
``torch.distributed.tensor.parallel`` on the ``tp`` dimension of the run's device mesh.

Apply it to the model on the meta device, after activation checkpointing and compile and before FSDP2: each split
parameter becomes a DTensor on the ``tp`` mesh (FSDP2 then shards it further over the data-parallel dimensions),
and forward hooks move activations between the layouts the plan names. Nothing is allocated or communicated here.

Every rank of a tensor-parallel group must be given the same batch, of a sequence length the degree divides (the
sequence is split evenly among the group; ``check_sequence_length`` says so in one line otherwise).

The output layer and the loss: the projection is split along the vocabulary. Without a loss head its logits are
gathered whole on every rank (``[b, s, vocab]``, what the whole-logits loss takes); with the chunked loss
(``memory/chunked_loss.py``) the loss is computed on the vocabulary shards (loss parallel): each rank projects its
rows of the vocabulary only, and the softmax's maximum, normaliser and target logit are summed over the group.

The replicated weights' gradients (the norms') are partial sums on each rank of the group; FSDP2 sums them over the
group in its reduce dtype (``sum_replicated_gradients_in_reduce_dtype``).
"""

from __future__ import annotations

import inspect
import warnings
from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

from torchtune_ac.errors import UserError
from torchtune_ac.models.families import family_of, transformer_blocks
from torchtune_ac.models.tensor_parallel import Split, TensorParallelPlan, tensor_parallel_problem

SEQUENCE_DIM = 1  # activations are [b, s, dim]
HEADS_DIM = 2  # q and k before the per-head norms are [b, s, heads, head_dim]


class VocabParallelEmbedding(RowwiseParallel):
    """The embedding table split along the vocabulary (``Split.VOCAB_EMBEDDING``): each rank looks up the tokens in
    its rows (zeros elsewhere), and the partial lookups are summed and scattered along the sequence in one
    reduce-scatter.

    The result is waited for here, where ``RowwiseParallel`` hands on the collective's pending result (an
    ``AsyncCollectiveTensor``): a compiled first block given that computed no gradient for it (torch 2.13, on CPU:
    the embedding's gradient came back zero), and nothing runs between the two to overlap with anyway.
    """

    def __init__(self) -> None:
        super().__init__(input_layouts=Replicate(), output_layouts=Shard(SEQUENCE_DIM))

    @staticmethod
    def _prepare_output_fn(output_layouts, use_local_output, mod, outputs, device_mesh):
        return outputs.redistribute(placements=output_layouts, async_op=False).to_local()


class VocabParallelOutput(ColwiseParallel):
    """The output projection split along the vocabulary (``Split.VOCAB_OUTPUT``): its input, scattered along the
    sequence, is gathered whole; without a head the logits are gathered whole too; a loss head (called with the
    gathered hidden states and the vocabulary-split weight) returns its own result, which passes as it is.

    ``ColwiseParallel`` alone would drop the projection's second argument (the head) and expect a DTensor back.
    """

    def __init__(self) -> None:
        super().__init__(input_layouts=Shard(SEQUENCE_DIM), output_layouts=Replicate())

    @staticmethod
    def _prepare_input_fn(input_layouts, desired_input_layouts, mod, inputs, device_mesh):
        hidden = ColwiseParallel._prepare_input_fn(input_layouts, desired_input_layouts, mod, inputs, device_mesh)
        return (hidden, *inputs[1:])

    @staticmethod
    def _prepare_output_fn(output_layouts, use_local_output, mod, outputs, device_mesh):
        if not isinstance(outputs, DTensor):
            return outputs  # a loss head's result, already summed over the group
        return ColwiseParallel._prepare_output_fn(output_layouts, use_local_output, mod, outputs, device_mesh)


def _positional_inputs(module: nn.Module) -> int:
    """How many positional inputs ``module``'s forward takes (a checkpointed or compiled forward included)."""
    forward = getattr(module.forward, "original_forward", module.forward)
    return sum(1 for p in inspect.signature(forward).parameters.values()
               if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD))


def parallel_style(split: Split, module: nn.Module) -> ParallelStyle:
    """The torch ``ParallelStyle`` of one split of a family's plan, for ``module``."""
    if split is Split.VOCAB_EMBEDDING:
        return VocabParallelEmbedding()
    if split is Split.SEQUENCE:
        return SequenceParallel(sequence_dim=SEQUENCE_DIM, use_local_output=True)
    if split is Split.HEADS:
        return SequenceParallel(sequence_dim=HEADS_DIM, use_local_output=True)
    if split is Split.GATHER:
        others = (None,) * (_positional_inputs(module) - 1)
        return PrepareModuleInput(input_layouts=(Shard(SEQUENCE_DIM), *others),
                                  desired_input_layouts=(Replicate(), *others))
    if split is Split.COLUMN:
        return ColwiseParallel()
    if split is Split.ROW:
        return RowwiseParallel(output_layouts=Shard(SEQUENCE_DIM))
    if split is Split.VOCAB_OUTPUT:
        return VocabParallelOutput()
    raise ValueError(f"no parallel style for {split}")


def tensor_parallel_plan(model: nn.Module) -> TensorParallelPlan:
    """The plan of ``model``'s family.

    Raises:
        UserError: a model of no known family, or of a family without a plan.
    """
    family = family_of(model)
    if family is None or family.tensor_parallel_plan is None:
        what = f"family {family.name}" if family is not None else f"{type(model).__name__} (of no known family)"
        raise UserError(f"tensor_parallel_dim: {what} declares no tensor-parallel plan; set tensor_parallel_dim: 1")
    return family.tensor_parallel_plan(family.args_of(model))


def check_tensor_parallel_degree(model: nn.Module, degree: int) -> None:
    """Refuse, in one line naming the numbers, a degree ``model``'s plan cannot split.

    Raises:
        UserError: a size of the model (heads, key/value heads, MLP width) the degree does not divide.
    """
    problem = tensor_parallel_problem(tensor_parallel_plan(model), degree)
    if problem is not None:
        raise UserError(problem)


def apply_tensor_parallel(model: nn.Module, tp_mesh: DeviceMesh) -> None:
    """Split ``model`` across ``tp_mesh`` (a 1-D mesh, the run mesh's ``tp`` dimension) by its family's plan, in
    place: every block by the plan's ``block`` entries, then the root's modules. Ties are kept (a tied output and
    embedding share one vocabulary-split weight).

    Call on the meta-device model, after activation checkpointing and compile, before FSDP2.

    Raises:
        UserError: the model has no plan, or the mesh's size does not divide its heads or MLP width.
    """
    degree = tp_mesh.size()
    check_tensor_parallel_degree(model, degree)
    plan = tensor_parallel_plan(model)
    family = family_of(model)
    tied = family.hf.tied_parameters(family.args_of(model))
    for block in transformer_blocks(model):
        parallelize_module(block, tp_mesh, {path: parallel_style(split, block.get_submodule(path))
                                            for path, split in plan.block.items()})
        block.tensor_parallel = True  # its input split along the sequence: no target rows (``last_block_rows``)
    parallelize_module(model, tp_mesh, {path: parallel_style(split, model.get_submodule(path))
                                        for path, split in plan.root.items()})
    # Each style registered its module's own new parameter: put the ties back (the output's weight is the
    # embedding's; both are split along the vocabulary rows, so one DTensor serves both).
    for alias, source in tied.items():
        owner, _, attr = alias.rpartition(".")
        setattr(model.get_submodule(owner), attr, model.get_parameter(source))
    model.register_forward_pre_hook(_sequence_check(degree))
    # The styles hand on local views of their DTensor results (``to_local``), about which FSDP2 warns once per group
    # (an in-place op on such a view would skip its pre-backward hook): nothing in the model changes them in place.
    warnings.filterwarnings("ignore", message=r"FSDP2-wrapped module \(.*\) returned a view tensor",
                            category=UserWarning)


def _sequence_check(degree: int) -> Any:
    def check(module: nn.Module, args: tuple[Any, ...]) -> None:
        check_sequence_length(args[0].shape[-1], degree)

    return check


def check_sequence_length(length: int, degree: int) -> None:
    """Refuse a batch whose sequence length the tensor-parallel degree does not divide: its pieces would differ
    in length, which the sequence split does not take.

    Raises:
        ValueError: naming both numbers.
    """
    if length % degree:
        raise ValueError(f"a batch of sequence length {length} under tensor_parallel_dim={degree}: the length must be "
                         "a multiple of the degree (pad batches to a multiple of it)")


def sum_replicated_gradients_in_reduce_dtype(model: nn.Module, tp_dim: str) -> None:
    """Make FSDP2 sum the gradients of ``model``'s weights replicated over the ``tp_dim`` mesh dimension (the
    norms') in its reduce dtype (``fsdp.reduce_dtype``), not in the gathered parameters' dtype.

    Why: each rank of a tensor-parallel group holds a partial sum of a replicated weight's gradient (its part of
    the sequence). FSDP2 (torch 2.13 and earlier) sums those over the group in the gradient's own dtype, bf16 under
    mixed precision, and casts to the reduce dtype only for its reduce-scatter over the data-parallel dimensions
    (pytorch/pytorch#190626): a norm's gradient lost its low bits on every step. Here, each FSDP2 group holding
    such a weight casts every gradient it collects to the reduce dtype first, as FSDP2 does itself on its
    gradient-accumulation path (and as torch's proposed fix, pytorch/pytorch#190627, does); all of them, as one
    reduce-scatter takes one dtype. That holds the group's unsharded gradients in the reduce dtype while it
    reduces them (4 bytes a parameter instead of 2, one group at a time). Call after ``fully_shard``.
    """
    for module in model.modules():
        if not isinstance(module, FSDPModule):
            continue
        group = module._get_fsdp_state()._fsdp_param_group
        params = group.fsdp_params if group is not None else []
        if not any(_replicated_over(p.sharded_param, tp_dim) for p in params):
            continue
        for fsdp_param in params:
            fsdp_param._get_grad_inner_tensor = _cast_first(fsdp_param)


def _replicated_over(param: torch.Tensor, dim_name: str) -> bool:
    if not isinstance(param, DTensor):
        return False
    names = param.device_mesh.mesh_dim_names or ()
    return dim_name in names and isinstance(param.placements[names.index(dim_name)], Replicate)


def _cast_first(fsdp_param: Any) -> Any:
    """FSDP2's step from a parameter's gradient to the tensor it reduce-scatters (where it sums a partial gradient
    over the tensor-parallel group), given the gradient in the reduce dtype. FSDP2 sets ``reduce_dtype`` at its
    first forward (None: the gradient's own)."""
    get_inner = fsdp_param._get_grad_inner_tensor

    def cast_then_get(grad: torch.Tensor) -> torch.Tensor:
        dtype = fsdp_param.reduce_dtype
        if dtype is not None and isinstance(grad, DTensor) and grad.dtype != dtype:
            # Cast the local partial sum itself: a DTensor cast may sum a partial tensor first.
            grad = DTensor.from_local(grad.to_local().to(dtype), grad.device_mesh, grad.placements,
                                      run_check=False, shape=grad.shape, stride=grad.stride())
        return get_inner(grad)

    return cast_then_get
