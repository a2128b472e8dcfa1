"""DPO's reference model (``assemble.build_reference``): the policy's starting weights, frozen (no gradients, eval
mode), and on 2 processes sharded like the policy with every FSDP2 group resharded after its forward, which a
policy's root and last group are not (they wait for backward, which a reference never runs)."""

import torch
from gloo_testlib import run_on_gloo_ranks
from numerics import assert_close, llama_terms
from torch.distributed.fsdp import FSDPModule

from torchtune_ac.config.components import parse_component
from torchtune_ac.config.meta_model import build_meta_model
from torchtune_ac.memory.plan import MemoryPlan
from torchtune_ac.models.families.llama import LLAMA_TINY
from torchtune_ac.run.assemble import AssemblyPlan, build_reference, build_training
from torchtune_ac.runtime.distributed import DistributedContext
from torchtune_ac.parallel.fsdp import FSDPConfig
from torchtune_ac.runtime.dtypes import DType
from torchtune_ac.activation_checkpointing.config import ACConfig
from torchtune_ac.training.dpo import answer_logps

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
