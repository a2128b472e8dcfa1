"""The optimizer step inside backward: each parameter is updated as soon as its gradient is final, and its
gradient freed right away, so the gradients of the whole model never exist at once.

Each parameter gets an optimizer of its own, stepped in the parameter's post-accumulate-grad hook
(``Tensor.register_post_accumulate_grad_hook``). Under FSDP2 the hook is registered on the sharded parameters
after ``fully_shard``: FSDP2 sets the sharded gradient after its reduce-scatter and then calls that parameter's
hooks, so the hook sees the final, reduced gradient of its shard. With gradient accumulation the hooks let the
gradient accumulate on every micro-batch but the last, and step on the last one.

``OptimizerInBackward`` is a ``torch.optim.Optimizer`` whose ``param_groups`` are the per-parameter
optimizers' own groups, so an LR scheduler built on it sets the learning rate of every per-parameter step.
Its ``step()`` does nothing: the steps happen in backward. Its state is checkpointed through the per-parameter
optimizers (``optimizers``), which ``torch.distributed.checkpoint`` saves and loads by parameter name.
"""

from __future__ import annotations

import math
from typing import Any, Callable, Iterable, Optional

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor


class OptimizerInBackward(torch.optim.Optimizer):
    """One optimizer per parameter, each stepped in backward when its parameter's gradient is final.

    Args:
        named_parameters: the model's parameters that require gradients (sharded ones after ``fully_shard``).
        make_optimizer: builds the optimizer of one parameter, e.g. ``lambda params: AdamW(params, lr=1e-5)``.
    """

    def __init__(
        self,
        named_parameters: Iterable[tuple[str, nn.Parameter]],
        make_optimizer: Callable[[list[nn.Parameter]], torch.optim.Optimizer],
    ) -> None:
        params = [(name, p) for name, p in named_parameters if p.requires_grad]
        self.optimizers: list[torch.optim.Optimizer] = [make_optimizer([p]) for _, p in params]
        self.names = [name for name, _ in params]
        # What torch.optim.Optimizer.__init__ would set up, without taking ownership of the parameters.
        self.defaults = dict(self.optimizers[0].defaults) if self.optimizers else {}
        self._optimizer_step_pre_hooks: dict = {}
        self._optimizer_step_post_hooks: dict = {}
        self._optimizer_state_dict_pre_hooks: dict = {}
        self._optimizer_state_dict_post_hooks: dict = {}
        self._optimizer_load_state_dict_pre_hooks: dict = {}
        self._optimizer_load_state_dict_post_hooks: dict = {}
        self._zero_grad_profile_name = "OptimizerInBackward.zero_grad"
        self._final_micro_batch = True
        self._squared_norm: Optional[torch.Tensor] = None
        self._hooks = [p.register_post_accumulate_grad_hook(self._hook(opt)) for (_, p), opt in zip(params, self.optimizers)]

    @property
    def param_groups(self) -> list[dict[str, Any]]:  # type: ignore[override]
        return [group for optimizer in self.optimizers for group in optimizer.param_groups]

    @param_groups.setter
    def param_groups(self, value: Any) -> None:
        raise AttributeError("OptimizerInBackward's param_groups are its per-parameter optimizers' groups")

    @property
    def state(self) -> dict:  # type: ignore[override]
        return {p: s for optimizer in self.optimizers for p, s in optimizer.state.items()}

    @state.setter
    def state(self, value: Any) -> None:
        raise AttributeError("OptimizerInBackward's state lives in its per-parameter optimizers")

    def _hook(self, optimizer: torch.optim.Optimizer) -> Callable[[torch.Tensor], None]:
        def step_now(param: torch.Tensor) -> None:
            if not self._final_micro_batch:
                return  # let the gradient accumulate; the last micro-batch steps
            grad = param.grad
            local = grad.to_local() if isinstance(grad, DTensor) else grad
            # A float32 reduction, not a float32 copy of the gradient (that would double its memory).
            squared = torch.linalg.vector_norm(local.detach(), dtype=torch.float32).square()
            self._squared_norm = squared if self._squared_norm is None else self._squared_norm + squared
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)

        return step_now

    def begin_micro_batch(self, *, final: bool) -> None:
        """Say whether the coming backward is the last of this optimizer step (the one that steps)."""
        self._final_micro_batch = final
        if final:
            self._squared_norm = None

    def finish_step(self, device: torch.device) -> float:
        """The total gradient norm of the step the hooks just took (all ranks call this: the squared norms of
        each rank's shards are summed over ranks).

        Raises:
            RuntimeError: no hook ran (a backward without ``begin_micro_batch(final=True)`` before it).
        """
        if self._squared_norm is None:
            raise RuntimeError("no parameter was stepped in backward: call begin_micro_batch(final=True) first")
        squared = self._squared_norm.to(device)
        if dist.is_available() and dist.is_initialized():
            dist.all_reduce(squared, op=dist.ReduceOp.SUM)
        self._squared_norm = None
        return math.sqrt(float(squared))

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


def optimizers_to_checkpoint(optimizer: torch.optim.Optimizer) -> list[torch.optim.Optimizer]:
    """The optimizers whose state a checkpoint holds: the per-parameter ones in backward, else ``optimizer``."""
    return list(optimizer.optimizers) if isinstance(optimizer, OptimizerInBackward) else [optimizer]


def build_optimizer(
    make_optimizer: Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer], model: nn.Module, *, in_backward: bool
) -> torch.optim.Optimizer:
    """The optimizer of ``model``: one over all its parameters, or, ``in_backward``, one per parameter stepped in
    backward (``OptimizerInBackward``). Build it after ``fully_shard``: in backward, the hooks go on the sharded
    parameters, which is where FSDP2 delivers the reduced gradients.

    Args:
        make_optimizer: the config's optimizer, called with the parameters (all, or one at a time).
        model: the model to train.
        in_backward: step each parameter in backward.
    """
    if in_backward:
        return OptimizerInBackward(model.named_parameters(), lambda params: make_optimizer(params))
    return make_optimizer(model.parameters())
