"""The optimizer step inside backward: each parameter is updated as soon as its gradient is final, and its
gradient freed right away, so the gradients of the whole model never exist at once.

Each parameter gets an optimizer of its own, stepped in the parameter's post-accumulate-grad hook
(``Tensor.register_post_accumulate_grad_hook``). Under FSDP2 the hook is registered on the sharded parameters
after ``fully_shard``: FSDP2 sets the sharded gradient after its reduce-scatter and then calls that parameter's
hooks, so the hook sees the final, reduced gradient of its shard. With gradient accumulation the hooks let the
gradient accumulate on every micro-batch but the last, and step on the last one.

``OptimizerInBackward`` composes the per-parameter optimizers. It is built as an ordinary
``torch.optim.Optimizer`` (through its own ``__init__``) over their parameter groups, the very same dicts, so an
LR scheduler built on it sets the learning rate of every per-parameter step, and nothing of the base class is
set by hand. Its ``step()`` does nothing: the steps happen in backward. Its state is checkpointed through the
per-parameter optimizers (``optimizers``), which ``torch.distributed.checkpoint`` saves and loads by parameter
name. ``InBackwardStepper`` is how the train step drives it (``training/step.py``'s ``Stepper``).

As a memory feature (``FEATURE``):

    optimizer_in_bwd: false | true

It cannot clip (the total norm is known only once every parameter has been stepped), so it refuses
``clip_grad_norm``. The planner simulates the step with the optimizer in backward, so it needs no cost declared
here; under FSDP2 the root's gradients (embeddings, output) are reduced, and so stepped, only when backward ends,
which the simulation keeps (``planner/simulation.py``'s ``_LiveStorages``): they stay whole on every process until then.

On a GPU under FSDP2 the hooks, and so the steps, run on FSDP2's reduce-scatter stream: left there, so that
the step overlaps the next block's backward rather than making the default stream wait for each reduce-scatter;
the planner counts the step's temporaries in that stream's pool (``planner.in_backward_stream_pool``).
"""

from __future__ import annotations

from typing import Any, Callable, Iterable, Optional

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from torchtune_ac.errors import UserError
from torchtune_ac.memory.feature import Alternative, Feature, ResolveInputs
from torchtune_ac.parallel.fsdp import offloaded_gradient_wait
from torchtune_ac.training.gradient_norm import GradientNorm
from torchtune_ac.training.step import NormCheck, OptimizerStepper


class OptimizerInBackward(torch.optim.Optimizer):
    """One optimizer per parameter, each stepped in backward when its parameter's gradient is final.

    Args:
        named_parameters: the model's parameters that require gradients (sharded ones after ``fully_shard``).
        make_optimizer: builds the optimizer of one parameter, e.g. ``lambda params: AdamW(params, lr=1e-5)``.
        wait_for_gradient: called with a parameter before its hook reads the gradient, to wait until the gradient
            is in place (``parallel.fsdp.offloaded_gradient_wait``: FSDP2's copy into host memory with CPU
            offload); None: the gradient is in place when the hook runs.
        mesh: the run's device mesh, over which the gradient norm is summed (``training/gradient_norm.py``); None:
            the one the parameters are sharded over, or none.
    """

    def __init__(
        self,
        named_parameters: Iterable[tuple[str, nn.Parameter]],
        make_optimizer: Callable[[list[nn.Parameter]], torch.optim.Optimizer],
        wait_for_gradient: Optional[Callable[[torch.Tensor], None]] = None,
        mesh: Optional[DeviceMesh] = None,
    ) -> None:
        params = [(name, p) for name, p in named_parameters if p.requires_grad]
        if not params:
            raise ValueError("OptimizerInBackward needs at least one parameter that requires a gradient")
        self.optimizers: list[torch.optim.Optimizer] = [make_optimizer([p]) for _, p in params]
        self.names = [name for name, _ in params]
        # The per-parameter optimizers' own group dicts become this optimizer's groups (the base class keeps the
        # dicts it is given), so a scheduler's learning rate reaches every per-parameter step.
        groups = [group for optimizer in self.optimizers for group in optimizer.param_groups]
        super().__init__(groups, dict(self.optimizers[0].defaults))
        # Loading a state dict gives an optimizer new group dicts: share the loaded ones again (a public hook).
        for index, optimizer in enumerate(self.optimizers):
            optimizer.register_load_state_dict_post_hook(self._share_groups_of(index))
        self._wait_for_gradient = wait_for_gradient
        self._final_micro_batch = True
        self.gradient_norm = GradientNorm((p for _, p in params), mesh)
        # The norms of this rank's pieces of the gradients its hooks stepped this step, by part (``local_norms``).
        self._norms: tuple[list[torch.Tensor], list[torch.Tensor]] = ([], [])
        self._hooks = [p.register_post_accumulate_grad_hook(self._hook(opt)) for (_, p), opt in zip(params, self.optimizers)]

    def _share_groups_of(self, index: int) -> Callable[[torch.optim.Optimizer], None]:
        def share(optimizer: torch.optim.Optimizer) -> None:
            (self.param_groups[index],) = optimizer.param_groups

        return share

    def _hook(self, optimizer: torch.optim.Optimizer) -> Callable[[torch.Tensor], None]:
        def step_now(param: torch.Tensor) -> None:
            if not self._final_micro_batch:
                return  # let the gradient accumulate; the last micro-batch steps
            if self._wait_for_gradient is not None:
                self._wait_for_gradient(param)
            for norms, measured in zip(self._norms, self.gradient_norm.local_norms((param,))):
                norms += measured
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)

        return step_now

    def begin_micro_batch(self, *, final: bool) -> None:
        """Say whether the coming backward is the last of this optimizer step (the one that steps)."""
        self._final_micro_batch = final
        if final:
            self._norms = ([], [])

    def total_norm(self, device: torch.device) -> torch.Tensor:
        """The total gradient norm of the step the hooks just took, a 0-d tensor (all ranks call this:
        ``GradientNorm.total``). No host synchronisation.

        Args:
            device: where the norm goes without a mesh (with one, it is reduced on the mesh's device).

        Raises:
            RuntimeError: no hook ran (a backward without ``begin_micro_batch(final=True)`` before it).
        """
        if not any(self._norms):
            raise RuntimeError("no parameter was stepped in backward: call begin_micro_batch(final=True) first")
        norms, self._norms = self._norms, ([], [])
        total = self.gradient_norm.total(norms)
        return total if self.gradient_norm.groups is not None else total.to(device)

    @torch.no_grad()
    def step(self, closure: Optional[Callable[[], float]] = None) -> Optional[float]:  # noqa: D401
        """Nothing to do: every parameter was stepped in backward."""
        return None

    def zero_grad(self, set_to_none: bool = True) -> None:
        for optimizer in self.optimizers:
            optimizer.zero_grad(set_to_none=set_to_none)

    def state_dict(self) -> dict[str, Any]:
        raise NotImplementedError(
            "OptimizerInBackward has no state of its own: checkpoint its per-parameter `optimizers` "
            "(torch.distributed.checkpoint.state_dict.get_optimizer_state_dict(model, optimizer.optimizers))"
        )

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        raise NotImplementedError("load the per-parameter `optimizers` instead (see state_dict)")

    def remove_hooks(self) -> None:
        """Stop stepping in backward (the hooks are removed)."""
        for handle in self._hooks:
            handle.remove()
        self._hooks = []


class InBackwardStepper:
    """The ``Stepper`` of an ``OptimizerInBackward``: each parameter is stepped by its hook in the last
    micro-batch's backward, so ``update`` only collects the norm the hooks measured."""

    def __init__(self, optimizer: OptimizerInBackward) -> None:
        self.optimizer = optimizer

    def begin_micro_batch(self, *, final: bool) -> None:
        self.optimizer.begin_micro_batch(final=final)

    def update(self, model: nn.Module, clip_grad_norm: Optional[float],
               check_norm: Optional[NormCheck] = None) -> torch.Tensor:
        if clip_grad_norm is not None:
            raise ValueError("clip_grad_norm cannot be applied when the optimizer steps in backward")
        self.optimizer.step()  # nothing left to step; an LR scheduler still sees that the step happened
        self.optimizer.zero_grad(set_to_none=True)
        norm = self.optimizer.total_norm(next(model.parameters()).device)
        if check_norm is not None:
            check_norm(norm, stepped=True)
        return norm

    def optimizers_to_checkpoint(self) -> list[torch.optim.Optimizer]:
        return list(self.optimizer.optimizers)


def optimizers_to_checkpoint(stepper: Any) -> list[torch.optim.Optimizer]:
    """The optimizers whose state a checkpoint holds (``stepper.optimizers_to_checkpoint()``)."""
    return stepper.optimizers_to_checkpoint()


def build_optimizer(
    make_optimizer: Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer], model: nn.Module, *, in_backward: bool,
    mesh: Optional[DeviceMesh] = None,
) -> Any:
    """The stepper of ``model``'s parameters: one optimizer over all of them stepped after backward, or, with
    ``in_backward``, one per parameter stepped in backward (``OptimizerInBackward``). Build it after
    ``fully_shard``: in backward, the hooks go on the sharded parameters, which is where FSDP2 delivers the
    reduced gradients.

    Args:
        make_optimizer: the config's optimizer, called with the parameters that train (all, or one at a time).
        model: the model to train.
        in_backward: step each parameter in backward.
        mesh: the run's device mesh (``Parallelism.build_mesh``), over which the gradient norm is summed; None: the
            one the parameters are sharded over, or none.

    Returns:
        A ``training.step.Stepper``; its ``optimizer`` is what an LR scheduler drives.
    """
    if in_backward:
        return InBackwardStepper(OptimizerInBackward(model.named_parameters(), lambda params: make_optimizer(params),
                                                     wait_for_gradient=offloaded_gradient_wait(model), mesh=mesh))
    # Only what trains has state: a frozen base (adapters, ``torchtune_ac/lora/``) has none.
    return OptimizerStepper(make_optimizer([p for p in model.parameters() if p.requires_grad]), mesh)


# ----------------------------------------------------------------------------------------------------- the feature


def _resolve(inputs: ResolveInputs) -> bool:
    in_backward = inputs.memory.optimizer_in_bwd
    if in_backward and inputs.clip_grad_norm is not None:
        raise UserError(
            f"optimizer_in_bwd=true with clip_grad_norm={inputs.clip_grad_norm}: in backward each parameter is "
            "updated as soon as its gradient is ready, before the total norm that clipping scales by is known; "
            "set clip_grad_norm: null, or optimizer_in_bwd: false"
        )
    return in_backward


def _describe(setting: bool, vocab_size: Optional[int]) -> str:
    return ("in backward: each parameter stepped as its gradient is ready, gradients freed at once"
            if setting else "after backward")


def _alternatives(setting: bool) -> list[Alternative]:
    if setting:
        return []
    # Gradients accumulated over micro-batches must live until the last one, so the step in backward frees them
    # only without accumulation (torchtune requires that outright).
    return [Alternative("optimizer_in_bwd=true (with clip_grad_norm: null, gradient_accumulation_steps: 1)", True,
                        {"clip_grad_norm": None, "gradient_accumulation_steps": 1})]


def _resume_record(setting: bool) -> dict:
    # Recorded only when on, so runs from before the feature existed still resume.
    return {"optimizer_in_bwd": True} if setting else {}


FEATURE = Feature(name="optimizer_in_bwd", label="optimizer step", off=False, resolve=_resolve, describe=_describe,
                  alternatives=_alternatives, resume_record=_resume_record)
