"""A non-finite loss or gradient norm stops the step before the optimizer step (with the optimizer in backward:
after its hooks, flagged as such), naming for a loss the micro-batch and the ranks; all of it read from the device
once per step. Injected by wrapping the loss of one micro-batch, and by a gradient hook."""

from __future__ import annotations

import pytest
import torch

from torchtune_ac.memory.optimizer_in_backward import build_optimizer
from torchtune_ac.models import Llama, LlamaArgs
from torchtune_ac.runtime.distributed import DistributedContext
from torchtune_ac.runtime.non_finite import NonFiniteError
from torchtune_ac.training import step as step_module
from torchtune_ac.training.objective import IGNORE_INDEX
from torchtune_ac.training.step import train_step

ARGS = LlamaArgs(vocab_size=96, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, intermediate_dim=64, max_seq_len=64)
CTX = DistributedContext(0, 1, 0, torch.device("cpu"))
ACCUMULATION = 3


def _setup(in_backward: bool) -> tuple[Llama, torch.optim.Optimizer, list[dict[str, torch.Tensor]]]:
    torch.manual_seed(0)
    model = Llama(ARGS)
    model.init_weights(0.02)
    optimizer = build_optimizer(lambda params: torch.optim.AdamW(params, lr=1e-2), model, in_backward=in_backward)
    batches = []
    for _ in range(ACCUMULATION):
        tokens = torch.randint(0, ARGS.vocab_size, (2, 12))
        labels = torch.roll(tokens, -1, dims=1)
        labels[:, -1] = IGNORE_INDEX
        batches.append({"tokens": tokens, "labels": labels})
    return model, optimizer, batches


def _weights(model: Llama) -> dict[str, torch.Tensor]:
    return {name: value.detach().clone() for name, value in model.state_dict().items()}


@pytest.mark.parametrize("in_backward", [False, True], ids=["step_after_backward", "step_in_backward"])
@pytest.mark.parametrize("value", [float("nan"), float("inf")])
def test_a_non_finite_loss_stops_the_step_naming_the_micro_batch(monkeypatch, in_backward, value):
    model, optimizer, batches = _setup(in_backward)
    before = _weights(model)
    calls = []
    real_loss = step_module.micro_batch_loss

    def loss_of(model, batch, objective):
        calls.append(1)
        loss = real_loss(model, batch, objective)
        return loss * value if len(calls) == 2 else loss  # the second micro-batch goes bad

    monkeypatch.setattr(step_module, "micro_batch_loss", loss_of)
    with pytest.raises(NonFiniteError) as caught:
        train_step(model, optimizer, batches, ctx=CTX)
    err = caught.value
    assert (err.what, err.micro_batch, err.ranks, err.stepped) == ("loss", 1, [0], in_backward)
    assert f"the loss of micro-batch 2 of {ACCUMULATION} is {value} (rank 0)" in str(err)
    assert len(calls) == ACCUMULATION  # read once, after the last backward
    after = _weights(model)
    unchanged = all(torch.equal(after[name], before[name]) for name in before)  # bit for bit unless stepped
    # After backward, no optimizer step took it in; in backward the hooks stepped (the recipe saves nothing then).
    assert unchanged != in_backward


@pytest.mark.parametrize("in_backward", [False, True], ids=["step_after_backward", "step_in_backward"])
def test_a_non_finite_gradient_norm_stops_the_step(in_backward):
    model, optimizer, batches = _setup(in_backward)
    before = _weights(model)
    model.norm.weight.register_hook(lambda grad: grad * float("inf"))
    with pytest.raises(NonFiniteError) as caught:
        train_step(model, optimizer, batches, ctx=CTX)
    err = caught.value
    assert err.what == "gradient norm" and err.micro_batch is None and err.stepped == in_backward
    assert f"every one of the {ACCUMULATION} micro-batch loss(es) was finite" in str(err)
    after = _weights(model)
    unchanged = all(torch.equal(after[name], before[name]) for name in before)  # bit for bit unless stepped
    # After backward, nothing was stepped; in backward the hooks stepped already (the recipe saves nothing then).
    assert unchanged != in_backward


def test_finite_steps_are_untouched_by_the_checks():
    model, optimizer, batches = _setup(False)
    result = train_step(model, optimizer, batches, ctx=CTX)
    assert torch.isfinite(torch.tensor([result.loss, result.grad_norm])).all()
    model_b, optimizer_b, _ = _setup(False)
    loss_sum = step_module.accumulate_gradients(model_b, optimizer_b, batches, scale=1.0)  # the planner's path
    assert torch.isfinite(loss_sum)


def test_the_error_can_be_rebuilt_from_its_fields():
    err = NonFiniteError("loss", float("nan"), micro_batch=0, micro_batches=1, ranks=[1, 3])
    assert str(err) == "the loss of micro-batch 1 of 1 is nan (ranks 1, 3)"


def test_a_gradient_norm_in_host_memory_joins_device_losses_in_the_one_read():
    """With ``fsdp.cpu_offload`` FSDP2 keeps the gradients on the CPU, so the total norm comes back there while the
    loss slots are on the GPU. Fake tensors let a CPU-only machine hold "CUDA" tensors: the read's one tensor is on
    the losses' device, and holds the norm's value where the old ``torch.cat`` of mixed devices raised."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from torchtune_ac.runtime.non_finite import FiniteChecks

    cuda = torch.device("cuda", 0)
    with FakeTensorMode(allow_non_fake_inputs=True):
        checks = FiniteChecks(DistributedContext(0, 1, 0, cuda), micro_batches=2, device=cuda)
        gathered = checks.gather(torch.zeros((), device=cuda), torch.ones((), device="cpu"),
                                 torch.ones(2, dtype=torch.long, device=cuda))
    assert gathered.device == cuda
    assert gathered.shape == (2 + 1 + 1 + 2,)  # two losses, their sum, the norm, two counts


def test_the_read_brings_the_norm_and_counts_in_order():
    from torchtune_ac.runtime.non_finite import FiniteChecks

    checks = FiniteChecks(CTX, micro_batches=2, device=torch.device("cpu"))
    checks.record_loss(0, torch.tensor(1.5))
    checks.record_loss(1, torch.tensor(2.5))
    values = checks.read(torch.tensor(4.0), torch.tensor(0.25, dtype=torch.float64), torch.tensor([7, 9]))
    assert (values.loss_sum, values.grad_norm, values.target_tokens, values.input_tokens) == (4.0, 0.25, 7, 9)
