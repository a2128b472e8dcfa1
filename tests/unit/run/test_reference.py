"""DPO's reference model (``assemble.build_reference``): the policy's starting weights, frozen (no gradients, eval
mode), and on 2 processes sharded like the policy with every FSDP2 group resharded after its forward, which a
policy's root and last group are not (they wait for backward, which a reference never runs). Precomputed
(``run/reference.py``): only the pairs the run reads, a stop signal heard between two batches, and the sharded
model freed before the function returns."""

import dataclasses
import gc
import json
import signal
import weakref

import pytest
import torch
from gloo_testlib import run_on_gloo_ranks
from models_testlib import TINY, build_random_llama
from numerics import assert_close, llama_terms
from torch.distributed.fsdp import FSDPModule, fully_shard

from torchtune_ac.config.components import parse_component
from torchtune_ac.config.meta_model import build_meta_model
from torchtune_ac.data import EMBEDDED_TOKENIZER_DIR, build_dataloader, collate_preference_batch, load_tokenizer
from torchtune_ac.data import preference_dataset
from torchtune_ac.errors import RunStopped
from torchtune_ac.memory.plan import MemoryPlan
from torchtune_ac.models.families.llama import LLAMA_TINY
from torchtune_ac.run.assemble import AssemblyPlan, build_reference, build_training
from torchtune_ac.run.phases import RunData
from torchtune_ac.run.length import RunLength
from torchtune_ac.run.reference import precompute_reference, precompute_reference_logps
from torchtune_ac.run.session import Run
from torchtune_ac.runtime.distributed import DistributedContext, destroy_distributed, join_world_of_one
from torchtune_ac.parallel.fsdp import FSDPConfig
from torchtune_ac.runtime.dtypes import DType
from torchtune_ac.runtime.parallelism import Parallelism
from torchtune_ac.activation_checkpointing.config import ACConfig
from torchtune_ac.training.dpo import answer_logps, freeze_reference

SEED = 5
NODE = {"_component_": "torchtune_ac.models.llama_tiny"}


PLAN = AssemblyPlan(DType.FP32, MemoryPlan(ac=ACConfig().resolve(8)), FSDPConfig(), seed=SEED)


def _batch():
    generator = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, LLAMA_TINY.vocab_size, (4, 16), generator=generator)
    labels = torch.roll(tokens, -1, dims=1)
    labels[:, :6] = -100
    return {"tokens": tokens, "labels": labels}


def _gathered_groups(model) -> list[str]:
    """The FSDP2 groups of ``model`` whose parameters are gathered now."""
    gathered = []
    for name, module in model.named_modules():
        if isinstance(module, FSDPModule):
            group = module._get_fsdp_state()._fsdp_param_group
            if group is not None and group.is_unsharded:
                gathered.append(name or "root")
    return gathered


def test_the_reference_is_the_policys_starting_weights_frozen():
    ctx = DistributedContext(0, 1, 0, torch.device("cpu"))
    reference = build_reference(build_meta_model(parse_component(NODE, "model")), PLAN, ctx=ctx, checkpoint_dir=None)
    policy = build_training(build_meta_model(parse_component(NODE, "model")), PLAN, ctx=ctx).model
    assert not reference.training and not any(p.requires_grad for p in reference.parameters())
    assert all(torch.equal(p, q) for p, q in zip(reference.state_dict().values(), policy.state_dict().values()))


def sharded_reference(rank: int, out: str) -> None:
    ctx = DistributedContext(rank, 2, rank, torch.device("cpu"))
    reference = build_reference(build_meta_model(parse_component(NODE, "model")), PLAN, ctx=ctx, checkpoint_dir=None)
    policy = build_training(build_meta_model(parse_component(NODE, "model")), PLAN, ctx=ctx).model
    with torch.no_grad():
        logps = answer_logps(reference, _batch(), 1)
        answer_logps(policy, _batch(), 1)
    result = {"reference_gathered": _gathered_groups(reference), "policy_gathered": _gathered_groups(policy),
              "logps": logps, "grads": [p.grad for p in reference.parameters()]}
    if rank == 0:
        torch.save(result, out)


@pytest.mark.distributed
def test_sharded_over_2_processes_every_group_reshards_after_its_forward(tmp_path):
    out = tmp_path / "result.pt"
    run_on_gloo_ranks(sharded_reference, str(out), store_dir=tmp_path)
    result = torch.load(out, weights_only=False)
    # The policy's root and last group stay gathered until backward; the reference's would stay so for good.
    assert result["policy_gathered"] and result["reference_gathered"] == []
    assert all(grad is None for grad in result["grads"])
    ctx = DistributedContext(0, 1, 0, torch.device("cpu"))
    single = build_reference(build_meta_model(parse_component(NODE, "model")), PLAN, ctx=ctx, checkpoint_dir=None)
    with torch.no_grad():
        expected = answer_logps(single, _batch(), 1)
    # The same weights (drawn per block of rows, whatever the sharding), gathered: the same sums within rounding.
    assert_close(result["logps"], expected, terms=llama_terms(LLAMA_TINY, 16, 16, backward=False))


# ---------------------------------------------------------------------------------------- the precomputed reference

CPU_CTX = DistributedContext(0, 1, 0, torch.device("cpu"))
PAIR_ARGS = dataclasses.replace(TINY, vocab_size=512)  # the embedded tokenizer's vocabulary
BATCH = 2


@pytest.fixture(scope="module")
def pairs(tmp_path_factory):
    """Eight string pairs of different lengths, and the embedded tokenizer."""
    path = tmp_path_factory.mktemp("pairs") / "pairs.jsonl"
    path.write_text("".join(json.dumps({"prompt": f"What is {i} + {i}?", "chosen": str(2 * i),
                                        "rejected": f"{2 * i + 1} or so" + " really" * i}) + "\n" for i in range(8)))
    tokenizer = load_tokenizer(EMBEDDED_TOKENIZER_DIR)
    return str(path), tokenizer


def _run_data(source, tokenizer, *, steps, epochs=1):
    dataset = preference_dataset(tokenizer, source=source)
    loader = build_dataloader(dataset, batch_size=BATCH, pad_id=tokenizer.pad_id, seed=0,
                              collate=collate_preference_batch)
    length = RunLength(Parallelism(1), BATCH, 1, epochs, steps).counted(len(dataset), len(loader))
    return RunData(loader, len(dataset), {}), length


def _sharded_reference() -> torch.nn.Module:
    """A reference sharded by FSDP2 (a world of one), whose state and hooks hold reference cycles."""
    model = freeze_reference(build_random_llama(PAIR_ARGS, seed=3))
    for block in model.layers:
        fully_shard(block)
    return fully_shard(model)


@pytest.fixture
def world_of_one():
    join_world_of_one(torch.device("cpu"))
    yield
    destroy_distributed()


def test_only_the_pairs_the_run_reads_are_computed_as_a_whole_pass_computes_them(pairs):
    source, tokenizer = pairs
    data, length = _run_data(source, tokenizer, steps=2, epochs=2)  # 2 epochs of 2 steps of 2 pairs: 4 to 8 pairs
    reference = freeze_reference(build_random_llama(PAIR_ARGS, seed=3))
    precompute_reference(Run(None, CPU_CTX), lambda: reference, data, None, length=length, batch_size=BATCH,
                         pad_id=tokenizer.pad_id, n_chunks=1)
    sampler = data.loader.batch_sampler
    read = {int(i) for epoch in range(2) for i in sampler.indices_read(epoch, 2)}
    assert 4 <= len(read) < 8
    whole = preference_dataset(tokenizer, source=source)
    precompute_reference_logps(reference, whole, batch_size=BATCH, ctx=CPU_CTX, pad_id=tokenizer.pad_id)
    # Other batches (other padding), the same rows: the same sums within rounding.
    assert_close(torch.tensor([data.loader.dataset[i]["reference_logps"] for i in sorted(read)]),
                 torch.tensor([whole[i]["reference_logps"] for i in sorted(read)]),
                 terms=llama_terms(PAIR_ARGS, 40, 40, backward=False))
    unread = min(set(range(8)) - read)
    with pytest.raises(ValueError, match=f"pair {unread} has no precomputed reference log-probabilities"):
        data.loader.dataset[unread]
    for epoch in range(2):  # what the run reads is all there
        data.loader.set_epoch(epoch)
        for step, batch in enumerate(data.loader):
            if step == 2:
                break
            assert torch.isfinite(batch["reference_logps"]).all()


def test_the_sharded_reference_is_freed_before_the_pass_returns(pairs, world_of_one):
    source, tokenizer = pairs
    data, length = _run_data(source, tokenizer, steps=1)
    alive = []

    def make_reference():
        model = _sharded_reference()
        alive.append(weakref.ref(model))
        return model

    gc.disable()  # no collection by chance: only the one the pass runs
    try:
        precompute_reference(Run(None, CPU_CTX), make_reference, data, None, length=length, batch_size=BATCH,
                             pad_id=tokenizer.pad_id, n_chunks=1)
        assert alive[0]() is None
    finally:
        gc.enable()


def test_a_stop_signal_ends_the_pass_after_its_current_batch(pairs, monkeypatch):
    source, tokenizer = pairs
    data, length = _run_data(source, tokenizer, steps=4)
    run = Run(None, CPU_CTX)
    announced = []  # what the signal's first line says, during each forward
    reference = freeze_reference(build_random_llama(PAIR_ARGS, seed=3))
    reference.register_forward_hook(lambda *args: announced.append(run.stop.requested("SIGTERM")))
    run.stop.received = signal.SIGTERM  # as the handler sets it
    with pytest.raises(RunStopped) as stopped:
        precompute_reference(run, lambda: reference, data, None, length=length, batch_size=BATCH,
                             pad_id=tokenizer.pad_id, n_chunks=1)
    assert len(announced) == 1 and stopped.value.exit_status == 143
    assert announced[0].startswith("SIGTERM received during the reference's pass: stopping after its current batch, "
                                   "before training, with nothing to save")
    assert str(stopped.value).startswith("stopped by SIGTERM during the reference's pass (batch 1 of 4), before "
                                         "training: nothing to save")
    assert run.setting_up is None  # a signal after set-up finishes a step again
