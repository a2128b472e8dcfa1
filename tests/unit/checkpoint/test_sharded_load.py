"""Loading Hugging Face weights into an FSDP2-sharded model, and saving one: 2 CPU processes on gloo vs. 1 process."""

import dataclasses
import gc
import json
import weakref
from pathlib import Path

import pytest
import torch
from gloo_testlib import WORLD_SIZE, run_on_gloo_ranks
from models_testlib import TINY, save_random_checkpoint
from numerics import assert_close, llama_terms
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.fsdp import fully_shard

import torchtune_ac.checkpoint.hf as hf
import torchtune_ac.checkpoint.safetensors_io as safetensors_io
from torchtune_ac.checkpoint import CONFIG_FILE, INDEX_FILE
from torchtune_ac.errors import UserError
from torchtune_ac.models import LLAMA, Llama, load_hf, load_hf_weights_, save_hf

# An odd vocabulary makes the two shards of the embedding uneven (49 and 48 rows).
UNEVEN = dataclasses.replace(TINY, vocab_size=97, max_seq_len=64)
CASES = {"untied": UNEVEN, "tied": dataclasses.replace(UNEVEN, tie_embeddings=True)}


# Small enough to split the tiny model's ~100 KB into several files; larger than any one of its tensors.
SHARD_BYTES = 20_000


def sharded_model(args) -> Llama:
    with torch.device("meta"):
        model = Llama(args)
    for block in model.layers:
        fully_shard(block)
    fully_shard(model)
    model.to_empty(device="cpu")
    return model


def check_sharded_load(rank: int, case: str, ckpt: str) -> None:
    args = CASES[case]
    model = sharded_model(args)

    regions_read = {}
    read_region = hf.read_region

    def recording_read_region(f, name, region):
        regions_read.setdefault(name, []).append(region)
        return read_region(f, name, region)

    hf.read_region = recording_read_region
    try:
        load_hf_weights_(model, ckpt)
    finally:
        hf.read_region = read_region

    reference = load_hf(ckpt).eval()
    full_shapes = {LLAMA.hf.to_hf_name(k): tuple(v.shape) for k, v in reference.state_dict().items()}
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
            assert torch.equal(full[name], tensor), name  # loading copies bytes: no arithmetic
        with torch.no_grad():
            # The same weights, gathered into FSDP2's buffers: a matmul may block them otherwise, so within rounding.
            assert_close(sharded_logits, reference(tokens), terms=llama_terms(args, 24, 0, backward=False),
                         what="logits")


@pytest.mark.numerics
@pytest.mark.distributed
@pytest.mark.parametrize("case", sorted(CASES))
def test_fsdp2_sharded_load_matches_single_process(tmp_path, case):
    ckpt = save_random_checkpoint(tmp_path / "ckpt", args=CASES[case], seed=11)
    run_on_gloo_ranks(check_sharded_load, case, str(ckpt), store_dir=tmp_path)


def check_sharded_save(rank: int, case: str, ckpt: str, out: str) -> None:
    model = sharded_model(CASES[case])
    load_hf_weights_(model, ckpt)

    files, write = [], safetensors_io.save_file

    def recording_save_file(tensors, filename, metadata=None):
        gc.collect()
        # Everything gathered for earlier files is gone: rank 0 holds at most the file being written.
        assert all(ref() is None for _, refs in files for ref in refs), filename
        assert sum(t.numel() * t.element_size() for t in tensors.values()) <= SHARD_BYTES
        files.append((Path(filename).name, [weakref.ref(t) for t in tensors.values()]))
        return write(tensors, filename, metadata=metadata)

    safetensors_io.save_file = recording_save_file
    try:
        assert save_hf(model, out, max_shard_size=SHARD_BYTES) == Path(out)
        # A second save into the now non-empty directory fails on every rank (no rank waits in a gather).
        with pytest.raises(UserError, match="not empty"):
            save_hf(model, out, max_shard_size=SHARD_BYTES)
    finally:
        safetensors_io.save_file = write
    if rank == 0:
        index = json.loads((Path(out) / INDEX_FILE).read_text())
        assert [name for name, _ in files] == sorted(set(index["weight_map"].values()))
        assert len(files) >= 3
    else:
        assert files == []


@pytest.mark.distributed
@pytest.mark.parametrize("case", sorted(CASES))
def test_fsdp2_sharded_save_writes_one_file_at_a_time_and_equals_the_source(tmp_path, case):
    ckpt = save_random_checkpoint(tmp_path / "ckpt", args=CASES[case], seed=12)
    out = tmp_path / "saved"
    run_on_gloo_ranks(check_sharded_save, case, str(ckpt), str(out), store_dir=tmp_path)
    saved, source = load_hf(out).state_dict(), load_hf(ckpt).state_dict()
    assert saved.keys() == source.keys()
    for name, tensor in source.items():
        assert torch.equal(saved[name], tensor), name  # gathered and written bytes: no arithmetic
    assert json.loads((out / CONFIG_FILE).read_text()) == json.loads(
        (ckpt / CONFIG_FILE).read_text()
    )
