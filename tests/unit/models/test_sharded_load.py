"""Loading Hugging Face weights into an FSDP2-sharded model: 2 CPU processes on gloo vs. 1 process."""

import dataclasses

import pytest
import torch
from gloo_testlib import WORLD_SIZE, run_on_gloo_ranks
from models_testlib import TINY, save_random_checkpoint
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.fsdp import fully_shard

import torchtune_ac.models.hf_interop as hf_interop
from torchtune_ac.models import Llama, load_hf, load_hf_weights_

# An odd vocabulary makes the two shards of the embedding uneven (49 and 48 rows).
UNEVEN = dataclasses.replace(TINY, vocab_size=97, max_seq_len=64)
CASES = {"untied": UNEVEN, "tied": dataclasses.replace(UNEVEN, tie_embeddings=True)}


def check_sharded_load(rank: int, case: str, ckpt: str) -> None:
    args = CASES[case]
    with torch.device("meta"):
        model = Llama(args)
    for block in model.layers:
        fully_shard(block)
    fully_shard(model)
    model.to_empty(device="cpu")

    regions_read = {}
    read_region = hf_interop._read_region

    def recording_read_region(f, name, region):
        regions_read.setdefault(name, []).append(region)
        return read_region(f, name, region)

    hf_interop._read_region = recording_read_region
    try:
        load_hf_weights_(model, ckpt)
    finally:
        hf_interop._read_region = read_region

    reference = load_hf(ckpt).eval()
    full_shapes = {hf_interop.convert_name_to_hf(k): tuple(v.shape) for k, v in reference.state_dict().items()}
    tied_head = {"lm_head.weight"} if args.tie_embeddings else set()
    assert set(regions_read) == set(full_shapes) - tied_head
    for name, regions in regions_read.items():
        for region in regions:
            rows = region[0].stop - region[0].start
            # Every rank reads at most half of the rows (rounded up) of every tensor, never all of it.
            assert rows <= -(-full_shapes[name][0] // WORLD_SIZE), (name, region)
    for name, param in model.named_parameters():
        assert param.to_local().numel() < param.numel(), name

    tokens = torch.randint(0, args.vocab_size, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        sharded_logits = model.eval()(tokens)
    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if rank == 0:
        expected = reference.state_dict()
        assert full.keys() == expected.keys()
        for name, tensor in expected.items():
            assert torch.equal(full[name], tensor), name
        with torch.no_grad():
            assert torch.allclose(sharded_logits, reference(tokens), atol=1e-5, rtol=0)


@pytest.mark.distributed
@pytest.mark.parametrize("case", sorted(CASES))
def test_fsdp2_sharded_load_matches_single_process(tmp_path, case):
    ckpt = save_random_checkpoint(tmp_path / "ckpt", args=CASES[case], seed=11)
    run_on_gloo_ranks(check_sharded_load, case, str(ckpt), store_dir=tmp_path)
