"""Random initialisation (``checkpoint_dir: null``) of an FSDP2-sharded model: 2 CPU processes on gloo give the
weights 1 process gives for the same seed (not one rank's shard repeated in every shard), each parameter drawn
from a CPU generator of its own, and no rank holds more than one full parameter on the host while it builds.

The device's own generator is never drawn from: the single-process test below pins every value to a CPU
generator, which is what makes a run on one GPU start from the weights of a run on N (not shown here: no GPU)."""

import weakref

import pytest
import torch
from gloo_testlib import WORLD_SIZE, run_on_gloo_ranks
from hf_families import FAMILY_NAMES, HF_CLASSES, TINY_SHAPE
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from torchtune_ac.config.components import parse_component
from torchtune_ac.config.meta_model import build_meta_model
from torchtune_ac.memory.plan import MemoryPlan
from torchtune_ac.models import LLAMA
from torchtune_ac.models.families import family_of, init_weights_, model_from_hf_config
from torchtune_ac.models.families.llama import LLAMA_TINY
from torchtune_ac.run import weights
from torchtune_ac.run.assemble import AssemblyPlan, build_training
from torchtune_ac.run.weights import parameter_seed
from torchtune_ac.runtime.distributed import DistributedContext
from torchtune_ac.parallel.fsdp import FSDPConfig
from torchtune_ac.runtime.dtypes import DType
from torchtune_ac.activation_checkpointing.config import ACConfig

SEED = 3
# llama_tiny (512 x 128 embedding, 8 blocks), and the same with tied embeddings.
TIED_CONFIG = {**LLAMA.hf.hf_config_from_args(LLAMA_TINY, torch.float32), "tie_word_embeddings": True}
MODELS = {
    "untied": {"_component_": "torchtune_ac.models.llama_tiny"},
    "tied": {"_component_": "torchtune_ac.models.from_hf_config", "checkpoint_dir": TIED_CONFIG},
}


def build(node: dict, ctx: DistributedContext) -> torch.nn.Module:
    return build_training(build_meta_model(parse_component(node, "model")),
                          AssemblyPlan(dtype=DType.FP32, memory=MemoryPlan(ac=ACConfig().resolve(8)),
                                       seed=SEED), ctx=ctx).model


class HostTensorBytes(TorchDispatchMode):
    """The peak bytes of plain host tensors alive at once, among those the ops it sees create (a rank's local
    shards among them: the CPU is their device here)."""

    def __init__(self) -> None:
        super().__init__()
        self.live: dict[int, int] = {}
        self.peak = 0

    def _free(self, key: int) -> None:
        self.live.pop(key, None)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for leaf in tree_flatten(out)[0]:
            if isinstance(leaf, torch.Tensor) and not isinstance(leaf, DTensor) and leaf.device.type == "cpu":
                storage = leaf.untyped_storage()
                if storage._cdata not in self.live:
                    self.live[storage._cdata] = storage.nbytes()
                    # The Python storage object lives exactly as long as its memory (PyObject preservation).
                    weakref.finalize(storage, self._free, storage._cdata)
        self.peak = max(self.peak, sum(self.live.values()))
        return out


def init_rank(rank: int, case: str, out_path: str, block_elements: int) -> None:
    weights.INIT_BLOCK_ELEMENTS = block_elements
    ctx = DistributedContext(rank=rank, world_size=WORLD_SIZE, local_rank=rank, device=torch.device("cpu"))
    with HostTensorBytes() as host:
        model = build(MODELS[case], ctx)
    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    torch.save(host.peak, f"{out_path}.{rank}.peak")
    if rank == 0:
        torch.save(full, out_path)


@pytest.mark.distributed
@pytest.mark.parametrize("case, block_elements", [("tied", weights.INIT_BLOCK_ELEMENTS), ("untied", 1000)],
                         ids=["tied", "untied-blocks-across-shards"])
def test_sharded_random_init_equals_one_process(case: str, block_elements: int, tmp_path, monkeypatch) -> None:
    """With 1000-element blocks (7 rows of the embedding) the shards' edges fall inside blocks."""
    monkeypatch.setattr(weights, "INIT_BLOCK_ELEMENTS", block_elements)
    out_path = str(tmp_path / "sharded.pt")
    run_on_gloo_ranks(init_rank, case, out_path, block_elements, store_dir=tmp_path)
    sharded = torch.load(out_path, weights_only=True)
    single = build(MODELS[case], DistributedContext(0, 1, 0, torch.device("cpu"))).state_dict()
    assert sharded.keys() == single.keys()
    for name, expected in single.items():
        assert torch.equal(sharded[name], expected), name  # bit for bit: the same seed, the same RNG kernel
    embedding = sharded["tok_embeddings.weight"]
    assert not torch.equal(embedding[:256], embedding[256:]), "each shard holds the same values"
    # No rank held a full copy of the model on the host: its own shards (the CPU is their device here) and one
    # full parameter at a time (at most the largest, the embedding), give or take FSDP2's padding of a shard.
    model_bytes = sum(t.numel() * t.element_size() for t in single.values())
    largest = max(t.numel() * t.element_size() for t in single.values())
    for rank in range(WORLD_SIZE):
        peak = torch.load(f"{out_path}.{rank}.peak")
        assert peak <= model_bytes / WORLD_SIZE + largest + 64 * 1024 < model_bytes, (rank, peak, largest, model_bytes)


def test_each_parameter_is_drawn_from_a_cpu_generator_of_its_own() -> None:
    """Every weight matrix is normal(0, 0.02) from ``Generator().manual_seed(parameter_seed(seed, name))`` on the
    CPU, whatever else drew random numbers before, and every norm scales by 1."""
    torch.manual_seed(12345)  # the global generators play no part
    model = build(MODELS["untied"], DistributedContext(0, 1, 0, torch.device("cpu")))
    for name, param in model.named_parameters():
        if name.endswith("norm.weight"):
            expected = torch.ones(param.shape)
        else:
            generator = torch.Generator().manual_seed(parameter_seed(SEED, name))
            expected = torch.empty(param.shape).normal_(0.0, 0.02, generator=generator)
        assert torch.equal(param.detach(), expected), name
    assert parameter_seed(SEED, "layers.0.attn.q_proj.weight") != parameter_seed(SEED, "layers.1.attn.q_proj.weight")


@pytest.mark.parametrize("dtype", [DType.FP32, DType.BF16])
def test_a_parameter_of_several_blocks_draws_each_block_from_its_own_generator(monkeypatch, dtype) -> None:
    """Block b of a parameter's rows is normal(0, 0.02) from ``parameter_seed(seed, name, b)``, drawn in float32 and
    rounded once to the storage dtype (bf16's own ``normal_`` on the CPU is serial and slow)."""
    monkeypatch.setattr(weights, "INIT_BLOCK_ELEMENTS", 1000)
    model = build_training(build_meta_model(parse_component(MODELS["untied"], "model")),
                           AssemblyPlan(dtype=dtype, memory=MemoryPlan(ac=ACConfig().resolve(8)),
                                        seed=SEED), ctx=DistributedContext(0, 1, 0, torch.device("cpu"))).model
    embedding = model.get_parameter("tok_embeddings.weight").detach()
    rows = 1000 // embedding.shape[1]
    blocks = [torch.empty(min(rows, embedding.shape[0] - start), embedding.shape[1]).normal_(
        0.0, 0.02, generator=torch.Generator().manual_seed(parameter_seed(SEED, "tok_embeddings.weight", index)))
        for index, start in enumerate(range(0, embedding.shape[0], rows))]
    assert len(blocks) > 2
    assert embedding.dtype == dtype.torch
    assert torch.equal(embedding, torch.cat(blocks).to(dtype.torch))


@pytest.mark.parametrize("family", FAMILY_NAMES)
def test_every_family_initialises_each_parameter_as_init_weights_does(family: str) -> None:
    """The rule for one parameter (the family's ``init_parameter``) is ``init_weights``'s, for every parameter of
    a tiny model of every family: what ``init_weights`` leaves constant (norms, biases) bit for bit, and the random
    matrices as normal(0, 0.02), drawn from the generator given."""
    config_class, _, settings = HF_CLASSES[family]
    model = model_from_hf_config(config_class(**{**TINY_SHAPE, **settings}).to_dict())
    torch.manual_seed(0)
    init_weights_(model)
    for name, param in model.named_parameters():
        drawn = torch.empty(param.shape)
        family_of(model).init_parameter(model, name, drawn, torch.Generator().manual_seed(7))
        if torch.all(param == param.flatten()[0]):
            assert torch.equal(drawn, param.detach()), name
        else:
            torch.manual_seed(7)
            assert torch.equal(drawn, torch.empty(param.shape).normal_(0.0, 0.02)), name
