"""FSDP2 on NCCL with one rank: the ordinary optimizer and the step in backward agree after 3 steps, the sharded
state goes through DCP and comes back unchanged, and the Hugging Face export gives transformers' logits.

One rank is enough to run every NCCL collective FSDP2 issues (all-gather, reduce-scatter) and DTensor state;
the gloo tests cover the arithmetic of several ranks. TF32 is turned off here, so that float32 rounding (the
bound of ``tests/numerics.py``) applies."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from numerics import assert_close, assert_weights_trained_alike, llama_terms
from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

from torchtune_ac.memory.plan import MemoryConfig, resolve_memory_plan
from torchtune_ac.models import save_hf
from torchtune_ac.models.llama import Llama, LlamaArgs
from torchtune_ac.runtime.distributed import DistributedContext, join_world_of_one
from torchtune_ac.parallel.fsdp import FSDPConfig
from torchtune_ac.runtime.parallelism import Parallelism
from torchtune_ac.runtime.dtypes import DType
from torchtune_ac.activation_checkpointing.config import ACConfig
from torchtune_ac.activation_checkpointing.mechanism import ACMode
from torchtune_ac.parallel.fsdp import shard_model
from torchtune_ac.training.step import train_step

ARGS = LlamaArgs(vocab_size=1024, dim=256, n_layers=4, n_heads=8, n_kv_heads=2, intermediate_dim=512, max_seq_len=128)
STEPS, LR, SEQ = 3, 1e-3, 128
CUDA = torch.device("cuda", 0)


@pytest.fixture(scope="module", autouse=True)
def nccl_world():
    tf32 = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    # As tune run starts it: NCCL for CUDA tensors with gloo beside it for CPU tensors (the checkpoint code's host
    # barrier sums a CPU tensor, which an NCCL-only group has no backend for).
    join_world_of_one(CUDA)
    yield
    dist.destroy_process_group()
    torch.backends.cuda.matmul.allow_tf32 = tf32


def batches() -> list[dict[str, torch.Tensor]]:
    generator = torch.Generator().manual_seed(3)
    out = []
    for _ in range(STEPS):
        tokens = torch.randint(0, ARGS.vocab_size, (2, SEQ), generator=generator)
        labels = torch.cat([tokens[:, 1:], torch.full_like(tokens[:, :1], -100)], dim=1)
        out.append({"tokens": tokens.to(CUDA), "labels": labels.to(CUDA)})
    return out


def sharded_model() -> Llama:
    torch.manual_seed(0)
    model = Llama(ARGS)
    model.init_weights()
    model.to(CUDA)
    shard_model(model, Parallelism(dist.get_world_size()).build_mesh("cuda"), FSDPConfig(), dtype=DType.FP32)
    return model


def meta_model() -> Llama:
    with torch.device("meta"):
        return Llama(ARGS)


def train(in_backward: bool):
    model = sharded_model()
    plan = resolve_memory_plan(ACConfig(ac_mode=ACMode("full")), MemoryConfig(optimizer_in_bwd=in_backward),
                               meta_model(), clip_grad_norm=None)
    stepper = plan.build_stepper(lambda params: torch.optim.AdamW(params, lr=LR), model)
    ctx = DistributedContext(rank=0, world_size=1, local_rank=0, device=CUDA)
    losses = [train_step(model, stepper, [batch], ctx=ctx, objective=plan.objective()).loss for batch in batches()]
    return model, stepper, losses


def full_weights(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {name: tensor.full_tensor().cpu() for name, tensor in model.state_dict().items()}


def test_the_ordinary_and_in_backward_optimizers_agree_after_3_steps():
    ordinary, _, ordinary_losses = train(in_backward=False)
    in_backward, _, in_backward_losses = train(in_backward=True)
    assert ordinary_losses[0] == in_backward_losses[0]  # the same weights and batch, before any step
    assert_weights_trained_alike(full_weights(in_backward), full_weights(ordinary), lrs=[LR] * STEPS,
                                 terms=llama_terms(ARGS, SEQ, 2 * SEQ))


def test_sharded_state_round_trips_through_dcp(tmp_path):
    model, stepper, _ = train(in_backward=False)
    optimizers = stepper.optimizers_to_checkpoint()
    state = {"model": get_model_state_dict(model), "optimizer": get_optimizer_state_dict(model, optimizers)}
    dcp.save(state, checkpoint_id=tmp_path / "state")
    fresh = sharded_model()
    fresh_stepper = resolve_memory_plan(ACConfig(), MemoryConfig(), meta_model(), clip_grad_norm=None).build_stepper(
        lambda params: torch.optim.AdamW(params, lr=LR), fresh)
    loaded = {"model": get_model_state_dict(fresh),
              "optimizer": get_optimizer_state_dict(fresh, fresh_stepper.optimizers_to_checkpoint())}
    dcp.load(loaded, checkpoint_id=tmp_path / "state")
    for name, tensor in state["model"].items():
        assert torch.equal(loaded["model"][name].full_tensor(), tensor.full_tensor()), name  # a copy of the bytes
    for key, value in state["optimizer"]["state"].items():
        for field, tensor in value.items():
            got = loaded["optimizer"]["state"][key][field]
            full = (lambda t: t.full_tensor() if hasattr(t, "full_tensor") else t)
            assert torch.equal(full(got), full(tensor)), (key, field)


def test_hugging_face_export_of_a_sharded_model_gives_transformers_logits(tmp_path):
    transformers = pytest.importorskip("transformers")
    model, _, _ = train(in_backward=False)
    save_hf(model, tmp_path / "hf")
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32).to(CUDA).eval()
    tokens = batches()[0]["tokens"]
    with torch.no_grad():
        ours = model(tokens).float()
        theirs = hf(input_ids=tokens, use_cache=False).logits.float()
    assert_close(ours, theirs, terms=llama_terms(ARGS, SEQ, 0, backward=False), what="logits")
