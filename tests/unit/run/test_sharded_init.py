"""Random initialisation (``checkpoint_dir: null``) of an FSDP2-sharded model: 2 CPU processes on gloo give the
weights 1 process gives for the same seed (not one rank's shard repeated in every shard)."""

import pytest
import torch
from gloo_testlib import WORLD_SIZE, run_on_gloo_ranks
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

from torchtune_ac.config.components import parse_component
from torchtune_ac.memory.activation_checkpointing import ACConfig
from torchtune_ac.memory.plan import MemoryPlan
from torchtune_ac.models import LLAMA
from torchtune_ac.models.families.llama import LLAMA_TINY
from torchtune_ac.run.model_setup import build_training_model
from torchtune_ac.runtime.distributed import DistributedContext, FSDPConfig
from torchtune_ac.runtime.dtypes import DType

SEED = 3
# llama_tiny (512 x 128 embedding, 8 blocks), and the same with tied embeddings.
TIED_CONFIG = {**LLAMA.hf.hf_config_from_args(LLAMA_TINY, torch.float32), "tie_word_embeddings": True}
MODELS = {
    "untied": {"_component_": "torchtune_ac.models.llama_tiny"},
    "tied": {"_component_": "torchtune_ac.models.from_hf_config", "checkpoint_dir": TIED_CONFIG},
}


def build(node: dict, ctx: DistributedContext) -> torch.nn.Module:
    return build_training_model(
        parse_component(node, "model"), ctx=ctx, dtype=DType.FP32, memory=MemoryPlan(ac=ACConfig().resolve(8), settings={}), fsdp=FSDPConfig(),
        compile_blocks=False, checkpoint_dir=None, seed=SEED,
    )


def init_rank(rank: int, case: str, out_path: str) -> None:
    ctx = DistributedContext(rank=rank, world_size=WORLD_SIZE, local_rank=rank, device=torch.device("cpu"))
    model = build(MODELS[case], ctx)
    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if rank == 0:
        torch.save(full, out_path)


@pytest.mark.distributed
@pytest.mark.parametrize("case", sorted(MODELS))
def test_sharded_random_init_equals_one_process(case: str, tmp_path) -> None:
    out_path = str(tmp_path / "sharded.pt")
    run_on_gloo_ranks(init_rank, case, out_path, store_dir=tmp_path)
    sharded = torch.load(out_path, weights_only=True)
    single = build(MODELS[case], DistributedContext(0, 1, 0, torch.device("cpu"))).state_dict()
    assert sharded.keys() == single.keys()
    for name, expected in single.items():
        assert torch.equal(sharded[name], expected), name  # bit for bit: the same seed, the same RNG kernel
    embedding = sharded["tok_embeddings.weight"]
    assert not torch.equal(embedding[:256], embedding[256:]), "each shard holds the same values"
