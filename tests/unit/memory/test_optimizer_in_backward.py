"""The optimizer step inside backward trains exactly like the ordinary step (the same losses and weights, bit for
bit, after 5 steps; the same learning rates; gradient norms within rounding), on 1 process and on 2 FSDP2
processes, with gradient accumulation and tied embeddings; and the whole set of gradients never exists at once.

Bit for bit because both run the same forward and backward, and AdamW on CPU runs its per-tensor (single-tensor)
arithmetic whether one optimizer holds every parameter or each parameter has its own. Only the gradient norm
adds in another order: the ordinary step takes it over all gradients at once, the hooks add each parameter's
squared norm as its gradient arrives."""

import dataclasses
from pathlib import Path

import pytest
import torch
from gloo_testlib import WORLD_SIZE, run_on_gloo_ranks
from models_testlib import TINY
from numerics import assert_close
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.fsdp import fully_shard

from torchtune_ac.memory.chunked_loss import loss_objective
from torchtune_ac.memory.optimizer_in_backward import OptimizerInBackward, build_optimizer
from torchtune_ac.models import Llama
from torchtune_ac.runtime.distributed import DistributedContext
from torchtune_ac.runtime.parallelism import GradientGroups
from torchtune_ac.training import cosine_schedule_with_warmup
from torchtune_ac.training.objective import IGNORE_INDEX
from torchtune_ac.training.step import train_step

STEPS = 5
ARGS = dataclasses.replace(TINY, vocab_size=97, n_layers=3)  # odd vocabulary: uneven FSDP2 shards


def adamw(params):
    return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.01)


def micro_batches(step: int, rank: int, accumulation: int) -> list[dict[str, torch.Tensor]]:
    out = []
    for micro in range(accumulation):
        generator = torch.Generator().manual_seed(1000 * step + 10 * rank + micro)
        tokens = torch.randint(0, ARGS.vocab_size, (2, 16), generator=generator)
        labels = torch.roll(tokens, -1, dims=1)
        labels[:, -1] = IGNORE_INDEX
        out.append({"tokens": tokens, "labels": labels})
    return out


def train(in_backward: bool, *, tied: bool, accumulation: int, loss_chunks: int = 1, ctx=None, shard: bool = False):
    """5 steps of the recipe's train_step; returns the model and each step's (loss, grad_norm, lr)."""
    ctx = ctx or DistributedContext(0, 1, 0, torch.device("cpu"))
    torch.manual_seed(0)
    model = Llama(dataclasses.replace(ARGS, tie_embeddings=tied))
    model.init_weights()
    if shard:
        for block in model.layers:
            fully_shard(block)
        fully_shard(model, reshard_after_forward=False)
    stepper = build_optimizer(adamw, model, in_backward=in_backward)
    scheduler = cosine_schedule_with_warmup(stepper.optimizer, num_warmup_steps=2, num_training_steps=STEPS)
    history = []
    for step in range(STEPS):
        result = train_step(model, stepper, micro_batches(step, ctx.rank, accumulation), ctx=ctx,
                            objective=loss_objective(loss_chunks))
        history.append((result.loss, result.grad_norm, stepper.optimizer.param_groups[0]["lr"]))
        scheduler.step()
    return model, history


def assert_same_history(history_a, history_b, n_gradients: int) -> None:
    """Losses and learning rates equal (see the module docstring); gradient norms within the rounding of a sum
    of ``n_gradients`` squares."""
    for (loss_a, norm_a, lr_a), (loss_b, norm_b, lr_b) in zip(history_a, history_b):
        assert loss_b == loss_a
        assert_close(norm_b, norm_a, terms=n_gradients, what="gradient norm")
        assert lr_b == lr_a


def assert_same_training(ordinary, in_backward) -> None:
    (model_a, history_a), (model_b, history_b) = ordinary, in_backward
    assert_same_history(history_a, history_b, sum(p.numel() for p in model_a.parameters()))
    state_a, state_b = model_a.state_dict(), model_b.state_dict()
    for name, tensor in state_a.items():
        assert torch.equal(state_b[name], tensor), name


@pytest.mark.numerics
@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
@pytest.mark.parametrize("accumulation", [1, 2])
def test_weights_equal_the_ordinary_step_on_one_process(tied, accumulation):
    assert_same_training(train(False, tied=tied, accumulation=accumulation),
                         train(True, tied=tied, accumulation=accumulation))


@pytest.mark.numerics
def test_it_composes_with_the_chunked_loss():
    assert_same_training(train(False, tied=True, accumulation=1, loss_chunks=3),
                         train(True, tied=True, accumulation=1, loss_chunks=3))


def test_the_scheduler_sets_every_parameters_learning_rate():
    model = Llama(ARGS)
    optimizer = OptimizerInBackward(model.named_parameters(), adamw)
    scheduler = cosine_schedule_with_warmup(optimizer, num_warmup_steps=4, num_training_steps=10)
    scheduler.step()
    lrs = {group["lr"] for opt in optimizer.optimizers for group in opt.param_groups}
    assert lrs == {1e-2 * 2 / 5}  # warm-up step 1 of 4: (1 + 1) / (4 + 1)
    assert len(optimizer.optimizers) == len(list(model.parameters()))


def test_the_whole_set_of_gradients_never_exists():
    torch.manual_seed(0)
    model = Llama(ARGS)
    params = list(model.parameters())
    live = []
    for p in params:  # registered first, so they run before the step frees the gradient
        p.register_post_accumulate_grad_hook(lambda _: live.append(sum(q.grad is not None for q in params)))
    optimizer = build_optimizer(adamw, model, in_backward=True)
    train_step(model, optimizer, micro_batches(0, 0, 1), ctx=DistributedContext(0, 1, 0, torch.device("cpu")))
    assert len(live) == len(params)
    assert max(live) <= 2  # the gradient being applied, and at most one more waiting for its hook
    assert all(p.grad is None for p in params)


def test_clipping_is_refused_in_backward():
    model = Llama(ARGS)
    optimizer = build_optimizer(adamw, model, in_backward=True)
    with pytest.raises(ValueError, match="clip_grad_norm"):
        train_step(model, optimizer, micro_batches(0, 0, 1), ctx=DistributedContext(0, 1, 0, torch.device("cpu")),
                   clip_grad_norm=1.0)


def train_two_processes(rank: int, out: str, tied: bool, accumulation: int) -> None:
    ctx = DistributedContext(rank, WORLD_SIZE, rank, torch.device("cpu"))
    results = {}
    for in_backward in (False, True):
        model, history = train(in_backward, tied=tied, accumulation=accumulation, ctx=ctx, shard=True)
        state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        results[in_backward] = (state, history)
    if rank == 0:
        torch.save(results, out)


@pytest.mark.numerics
@pytest.mark.distributed
@pytest.mark.parametrize("tied, accumulation", [(False, 1), (True, 2)], ids=["untied", "tied_accumulation_2"])
def test_weights_equal_the_ordinary_step_on_two_fsdp2_processes(tmp_path: Path, tied, accumulation):
    out = tmp_path / "results.pt"
    run_on_gloo_ranks(train_two_processes, str(out), tied, accumulation, store_dir=tmp_path)
    results = torch.load(out, weights_only=False)
    (state_a, history_a), (state_b, history_b) = results[False], results[True]
    assert_same_history(history_a, history_b, sum(t.numel() for t in state_a.values()))
    for name, tensor in state_a.items():
        assert torch.equal(state_b[name], tensor), name


def test_the_scheduler_still_reaches_every_parameter_after_a_state_dict_is_loaded():
    model = Llama(ARGS)
    optimizer = OptimizerInBackward(model.named_parameters(), adamw)
    saved = [opt.state_dict() for opt in optimizer.optimizers]
    for opt, state in zip(optimizer.optimizers, saved):
        opt.load_state_dict(state)  # new group dicts, as a resume gives them
    scheduler = cosine_schedule_with_warmup(optimizer, num_warmup_steps=4, num_training_steps=10)
    scheduler.step()
    assert {group["lr"] for opt in optimizer.optimizers for group in opt.param_groups} == {1e-2 * 2 / 5}


def test_with_cpu_offload_each_hook_waits_for_its_gradient_copy_before_stepping():
    """FSDP2 before torch 2.12 copies each reduced gradient into pinned host memory without blocking, records an
    event for it, and calls the gradient hooks at once; it waits for the copies only when backward ends. A CPU has
    no copy in flight, so each parameter's event is one that records when it is waited on: every parameter's
    step must come after the wait on its own copy (without the wait, the first wait is FSDP2's, after all steps)."""
    from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule

    from torchtune_ac.runtime.distributed import destroy_distributed, join_world_of_one

    join_world_of_one(torch.device("cpu"))
    try:
        torch.manual_seed(0)
        model = Llama(ARGS)
        for block in model.layers:
            fully_shard(block, offload_policy=CPUOffloadPolicy(pin_memory=False))
        fully_shard(model, offload_policy=CPUOffloadPolicy(pin_memory=False))
        stepper = build_optimizer(adamw, model, in_backward=True)
        events: list[tuple[str, int]] = []

        class CopyEvent:
            def __init__(self, param: torch.Tensor) -> None:
                self.param = param

            def synchronize(self) -> None:
                events.append(("wait", id(self.param)))

        fsdp_params = [fp for module in model.modules() if isinstance(module, FSDPModule)
                       for fp in module._get_fsdp_state()._fsdp_param_group.fsdp_params]
        assert fsdp_params and all(fp.offload_to_cpu for fp in fsdp_params)
        for fsdp_param in fsdp_params:  # as FSDP2 2.11 leaves them when it calls the hooks
            fsdp_param.grad_offload_event = CopyEvent(fsdp_param.sharded_param)
        for optimizer in stepper.optimizer.optimizers:
            (param,) = optimizer.param_groups[0]["params"]
            optimizer.register_step_pre_hook(lambda *_, p=param: events.append(("step", id(p))))
        train_step(model, stepper, micro_batches(0, 0, 1), ctx=DistributedContext(0, 1, 0, torch.device("cpu")))
        steps = [key for what, key in events if what == "step"]
        assert len(steps) == len(fsdp_params)
        for key in steps:
            assert events.index(("wait", key)) < events.index(("step", key))
    finally:
        destroy_distributed()


def test_the_in_backward_norm_is_reduced_on_the_device_of_the_mesh(monkeypatch):
    """With ``fsdp.cpu_offload`` the gradients' squared norms are on the CPU while the mesh is CUDA's, whose groups
    (beyond a 1-D mesh over every rank) may be split from NCCL alone: the norms are reduced on the mesh's device.
    A mesh of the meta device stands in for CUDA's here."""

    optimizer = OptimizerInBackward(torch.nn.Linear(2, 2).named_parameters(), adamw)
    # Norms of a weight and of a split one, on the CPU, as offloaded; the groups of a mesh of the meta device.
    optimizer._norms = ([torch.tensor(5.0).sqrt()], [torch.tensor(2.0)])
    optimizer.gradient_norm.groups = GradientGroups(shard=object(), shard_tp=object(), device_type="meta")
    reduced = []
    monkeypatch.setattr(torch.distributed, "all_reduce", lambda tensor, op=None, group=None: reduced.append(tensor))
    norm = optimizer.total_norm(torch.device("cpu"))
    assert [tensor.device.type for tensor in reduced] == ["meta", "meta"] and norm.device.type == "meta"
