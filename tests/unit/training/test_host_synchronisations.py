"""Host synchronisations per optimizer step: at most one (the read of the non-finite check, which brings the
logged values with it), whether the step logs or not, with 4 micro-batches.

Counted as the ops that make the host wait for a GPU: reading a value (``item``, ``int``, ``float``, ``tolist``),
a copy to the host, a blocking copy from the host (``non_blocking=False`` waits for the copy to finish), and the
ops whose output size depends on the data (``nonzero``, ``masked_select``, boolean-mask indexing). The step runs
on the meta device, standing in for the GPU, with the CPU as the host (no GPU here): the step issues the same
ops whatever the device, and an op counts when it reads from or waits on a meta tensor. Reads return zeros, so
the values are meaningless, and only the counts are asserted; the values are checked by the step's other tests
on the CPU. On a real GPU the count is the same: the read of ``FiniteChecks.read`` is the only one.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from models_testlib import TINY
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from torchtune_ac.data import collate_batch
from torchtune_ac.memory.chunked_loss import ChunkedCrossEntropyObjective
from torchtune_ac.memory.optimizer_in_backward import build_optimizer
from torchtune_ac.models import Llama
from torchtune_ac.runtime import stop as stop_module
from torchtune_ac.runtime.distributed import DistributedContext
from torchtune_ac.runtime.stop import StopSignals
from torchtune_ac.training.objective import IGNORE_INDEX, CrossEntropy
from torchtune_ac.training.step import move_batch, train_step

aten = torch.ops.aten
DEVICE = torch.device("meta")  # the GPU's stand-in
ACCUMULATION = 4
# Ops whose output size (or value) the host must read from the device.
DATA_DEPENDENT = {aten.nonzero.default, aten.masked_select.default, aten._unique2.default,
                  aten.unique_consecutive.default, aten.repeat_interleave.Tensor}


def _on_device(tensor: object) -> bool:
    return isinstance(tensor, torch.Tensor) and tensor.device.type == DEVICE.type


class HostSynchronisations(TorchDispatchMode):
    """Counts (and names) every op that would make the host wait for the device; reads give zeros."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is aten._local_scalar_dense.default and _on_device(args[0]):
            self.seen.append("read of a value (item/int/float)")
            return False if args[0].dtype == torch.bool else 0
        if func is aten._to_copy.default:
            source, target = args[0], kwargs.get("device", args[0].device)
            if _on_device(source) and torch.device(target).type == "cpu":
                self.seen.append(f"copy to the host {tuple(source.shape)}")
                return torch.zeros(source.shape, dtype=kwargs.get("dtype") or source.dtype)
            if source.device.type == "cpu" and torch.device(target).type == DEVICE.type \
                    and not kwargs.get("non_blocking", False):
                self.seen.append(f"blocking copy from the host {tuple(source.shape)}")
        if func is aten.copy_.default:
            target, source = args[:2]
            if _on_device(source) and target.device.type == "cpu":
                self.seen.append(f"copy to the host {tuple(source.shape)}")
                return target.zero_()
            if source.device.type == "cpu" and _on_device(target) and not (args[2:] or [kwargs.get("non_blocking")])[0]:
                self.seen.append(f"blocking copy from the host {tuple(source.shape)}")
        if func in DATA_DEPENDENT and any(_on_device(t) for t in tree_flatten((args, kwargs))[0]):
            self.seen.append(str(func))
            return torch.zeros(args[0].numel(), args[0].dim(), dtype=torch.long, device=DEVICE)
        if func in (aten.index.Tensor, aten.index_put.default, aten.index_put_.default) and _on_device(args[0]) \
                and any(i is not None and i.dtype == torch.bool for i in args[1]):
            self.seen.append(f"boolean-mask {func}")
            if func is aten.index.Tensor:  # as if every position were selected
                return args[0].reshape(-1, *args[0].shape[args[1][0].dim():]).clone()
        return func(*args, **kwargs)


def _batches(packed: bool) -> list[dict[str, torch.Tensor]]:
    """``ACCUMULATION`` micro-batches as the loader gives them (collated on the host), prompts ignored."""
    generator = torch.Generator().manual_seed(0)
    batches = []
    for _ in range(ACCUMULATION):
        samples = []
        for _ in range(2):
            tokens = torch.randint(0, TINY.vocab_size, (16,), generator=generator).tolist()
            labels = tokens[1:] + [IGNORE_INDEX]
            labels[:5] = [IGNORE_INDEX] * 5  # a prompt
            sample = {"tokens": tokens, "labels": labels}
            if packed:
                sample["document_ids"] = [0] * 6 + [1] * 10
            samples.append(sample)
        batches.append(collate_batch(samples, pad_id=0))
    return batches


def _count(*, packed: bool, chunked: bool, in_backward: bool, clip: bool) -> list[str]:
    with torch.device(DEVICE):
        model = Llama(dataclasses.replace(TINY, tie_embeddings=chunked))
    stepper = build_optimizer(lambda params: torch.optim.AdamW(params, lr=1e-3), model, in_backward=in_backward)
    objective = ChunkedCrossEntropyObjective(3) if chunked else CrossEntropy()
    ctx = DistributedContext(0, 1, 0, DEVICE)
    counter = HostSynchronisations()
    with counter:
        micro = [move_batch(batch, DEVICE) for batch in _batches(packed)]
        result = train_step(model, stepper, micro, ctx=ctx, objective=objective,
                            clip_grad_norm=1.0 if clip else None)
        # What the recipe logs: already host values.
        assert isinstance(result.loss, float) and isinstance(result.grad_norm, float)
        assert isinstance(result.target_tokens, int) and isinstance(result.input_tokens, int)
    return counter.seen


@pytest.mark.parametrize("packed", [False, True], ids=["padded", "packed"])
@pytest.mark.parametrize("chunked", [False, True], ids=["whole_logits", "chunked_loss"])
@pytest.mark.parametrize("in_backward", [False, True], ids=["step_after_backward", "step_in_backward"])
def test_a_step_of_four_micro_batches_synchronises_the_host_once(packed, chunked, in_backward):
    seen = _count(packed=packed, chunked=chunked, in_backward=in_backward, clip=not in_backward)
    # The one read: every rank's micro-batch losses, the step's loss, the gradient norm and the counts (targets,
    # inputs, target tokens).
    assert seen == ["copy to the host (" + str(ACCUMULATION + 1 + 1 + 3) + ",)"], seen


def test_the_stop_signal_check_reads_no_device(monkeypatch):
    """Every rank agrees on a stop signal once per step: an all-reduce of a host tensor (gloo), not of one on the
    GPU, whose value the host would wait for. (The all-reduce itself is replaced: one process, no group.)"""
    reduced = []
    monkeypatch.setattr(stop_module.dist, "all_reduce", lambda tensor, op: reduced.append(tensor.device))
    counter = HostSynchronisations()
    with counter:
        assert StopSignals().agreed(DistributedContext(0, 2, 0, DEVICE)) is None
    assert reduced == [torch.device("cpu")]
    assert counter.seen == []
