"""Hugging Face interop: logits parity both ways, round trips, sharding, atomic saves, tokenizer files."""

import json
import os

import pytest
import torch
from models_testlib import (
    PARITY_CASES,
    TINY,
    assert_same_state,
    build_random_hf_llama,
    build_random_llama,
    clone_state,
    save_random_checkpoint,
)
from numerics import assert_close, llama_terms
from safetensors import safe_open
from transformers import AutoModelForCausalLM

from torchtune_ac.checkpoint import INDEX_FILE, WEIGHTS_FILE, copy_tokenizer_files, parse_shard_size, read_hf_config
from torchtune_ac.errors import UserError
from torchtune_ac.models import load_hf, save_hf, save_hf_state_dict
from torchtune_ac.activation_checkpointing.config import setup_activation_checkpointing

SEQ_LEN = 40


def logits_terms(args) -> int:
    """The additions behind a forward's logits on ``SEQ_LEN`` tokens: transformers and we add in other orders
    (other attention kernels, RoPE and norm formulas), so logits agree within rounding."""
    return llama_terms(args, SEQ_LEN, 0, backward=False)


def random_tokens(vocab_size: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, vocab_size, (2, SEQ_LEN), generator=torch.Generator().manual_seed(seed))


@pytest.mark.numerics
@pytest.mark.parametrize("case", sorted(PARITY_CASES))
def test_load_hf_matches_transformers_logits(tmp_path, case):
    args = PARITY_CASES[case]
    hf_model = build_random_hf_llama(args, seed=1)
    hf_model.save_pretrained(tmp_path)  # safetensors
    tokens = random_tokens(args.vocab_size)

    ours = load_hf(tmp_path).eval()

    assert ours.args == args
    with torch.no_grad():
        expected = hf_model(tokens).logits
        actual = ours(tokens)
    assert_close(actual, expected, terms=logits_terms(args), what="logits")


@pytest.mark.numerics
@pytest.mark.parametrize("case", sorted(PARITY_CASES))
def test_save_hf_loads_in_transformers_with_same_logits(tmp_path, case):
    args = PARITY_CASES[case]
    ours = build_random_llama(args, seed=2)
    tokens = random_tokens(args.vocab_size, seed=1)

    save_hf(ours, tmp_path / "ckpt")
    hf_model = AutoModelForCausalLM.from_pretrained(tmp_path / "ckpt", attn_implementation="eager").eval()

    assert hf_model.dtype == torch.float32
    with torch.no_grad():
        expected = ours(tokens)
        actual = hf_model(tokens).logits
    assert_close(actual, expected, terms=logits_terms(args), what="logits")


@pytest.mark.numerics
def test_packed_documents_match_separate_runs():
    model = build_random_llama(PARITY_CASES["llama3_rope_scaling"], seed=3)
    lengths = [7, 20, 13]
    tokens = random_tokens(model.args.vocab_size)[:1]  # [1, 40]
    document_ids = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths)).unsqueeze(0)

    with torch.no_grad():
        packed = model(tokens, document_ids=document_ids)
        separate = torch.cat([model(part) for part in tokens.split(lengths, dim=1)], dim=1)

    # One causal call per document inside a row of 40 against rows of 7, 20 and 13: other matmul blocks.
    assert_close(packed, separate, terms=logits_terms(model.args), what="logits")
    # Without document ids the later documents would see earlier ones: the mask must matter.
    with torch.no_grad():
        assert (model(tokens) - separate).abs().max().item() > 1e-3


def test_load_save_load_round_trip_is_bit_identical(tmp_path):
    args = PARITY_CASES["mqa_tied"]
    build_random_hf_llama(args, seed=4).save_pretrained(tmp_path / "hf")
    first = load_hf(tmp_path / "hf")

    save_hf(first, tmp_path / "ours")
    second = load_hf(tmp_path / "ours")

    assert_same_state(clone_state(second), clone_state(first))
    assert second.output.weight is second.tok_embeddings.weight
    with safe_open(str(tmp_path / "ours" / WEIGHTS_FILE), "pt") as f:
        assert "lm_head.weight" not in f.keys()
    # Bytes copied, no arithmetic: bit for bit.
    with safe_open(str(tmp_path / "hf" / "model.safetensors"), "pt") as f_hf, safe_open(
        str(tmp_path / "ours" / WEIGHTS_FILE), "pt"
    ) as f_ours:
        for name in f_hf.keys():
            assert torch.equal(f_hf.get_tensor(name), f_ours.get_tensor(name)), name


def test_sharded_save_writes_index_and_loads_back(tmp_path):
    model = build_random_llama(TINY, seed=5)
    # Embedding and output are 96 * 32 * 4 = 12288 bytes each: 13000 forces several shards, and no shard
    # holds more than 13000 bytes unless it is a single tensor.
    out = save_hf(model, tmp_path / "sharded", max_shard_size=13_000)

    index = json.loads((out / INDEX_FILE).read_text())
    shard_files = sorted(set(index["weight_map"].values()))
    n = len(shard_files)
    assert n >= 3
    assert shard_files == [f"model-{i:05d}-of-{n:05d}.safetensors" for i in range(1, n + 1)]
    assert sorted(p.name for p in out.iterdir()) == sorted(["config.json", INDEX_FILE, *shard_files])
    assert not (out / WEIGHTS_FILE).exists()
    expected_total = sum(t.numel() * t.element_size() for t in model.state_dict().values())
    assert index["metadata"]["total_size"] == expected_total
    for name in shard_files:
        with safe_open(str(out / name), "pt") as f:
            sizes = [f.get_tensor(k).numel() * 4 for k in f.keys()]
        assert sum(sizes) <= 13_000 or len(sizes) == 1
    assert_same_state(clone_state(load_hf(out)), clone_state(model))


@pytest.mark.numerics
def test_sharded_save_loads_in_transformers(tmp_path):
    model = build_random_llama(TINY, seed=6)
    save_hf(model, tmp_path / "sharded", max_shard_size="20KB")
    hf_model = AutoModelForCausalLM.from_pretrained(tmp_path / "sharded", attn_implementation="eager").eval()
    tokens = random_tokens(TINY.vocab_size)
    with torch.no_grad():
        assert_close(hf_model(tokens).logits, model(tokens), terms=logits_terms(TINY), what="logits")


def test_bfloat16_checkpoint_records_dtype_and_loads(tmp_path):
    model = build_random_llama(TINY, seed=7).to(torch.bfloat16)
    save_hf(model, tmp_path / "bf16")

    assert read_hf_config(tmp_path / "bf16")["dtype"] == "bfloat16"
    assert AutoModelForCausalLM.from_pretrained(tmp_path / "bf16").dtype == torch.bfloat16
    loaded = load_hf(tmp_path / "bf16", dtype=torch.float32)
    assert loaded.tok_embeddings.weight.dtype == torch.float32
    assert torch.equal(loaded.tok_embeddings.weight, model.tok_embeddings.weight.float())  # bf16 -> fp32 is exact


def test_save_with_activation_checkpointing_applied(tmp_path):
    model = build_random_llama(TINY, seed=8)
    plain_keys = list(model.state_dict())
    setup_activation_checkpointing(model, ac_mode="selective", ac_option=2)

    save_hf(model, tmp_path / "ac")

    assert list(model.state_dict()) == plain_keys
    assert_same_state(clone_state(load_hf(tmp_path / "ac")), clone_state(model))


def test_save_hf_state_dict_writes_config_and_special_ids(tmp_path):
    model = build_random_llama(PARITY_CASES["llama3_rope_scaling"], seed=9)

    save_hf_state_dict(model.state_dict(), model.args, tmp_path / "out", bos_token_id=1, eos_token_id=[2, 3])

    config = read_hf_config(tmp_path / "out")
    expected = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "bos_token_id": 1,
        "eos_token_id": [2, 3],
        "pad_token_id": None,
        "rope_theta": 500000.0,
        "rope_scaling": {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 16,
        },
        "dtype": "float32",
    }
    assert {key: config[key] for key in expected} == expected


def test_save_refuses_non_empty_directory_and_keeps_it(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("mine")

    with pytest.raises(UserError, match="not empty"):
        save_random_checkpoint(out)

    assert [p.name for p in out.iterdir()] == ["keep.txt"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]


def test_save_into_existing_empty_directory(tmp_path):
    (tmp_path / "out").mkdir()
    save_random_checkpoint(tmp_path / "out")
    assert (tmp_path / "out" / WEIGHTS_FILE).is_file()


def test_overwrite_replaces_directory_whole(tmp_path):
    out = save_random_checkpoint(tmp_path / "out", seed=1, max_shard_size=13_000)
    (out / "stale.txt").write_text("old")

    save_random_checkpoint(out, seed=2, overwrite=True)

    assert sorted(p.name for p in out.iterdir()) == ["config.json", WEIGHTS_FILE]
    assert_same_state(clone_state(load_hf(out)), clone_state(build_random_llama(TINY, seed=2)))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]


def test_failed_save_leaves_old_checkpoint_and_no_temporary_files(tmp_path, monkeypatch):
    out = save_random_checkpoint(tmp_path / "out", seed=1)
    before = {p.name: p.read_bytes() for p in out.iterdir()}

    def fail(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr("torchtune_ac.checkpoint.safetensors_io.save_file", fail)
    with pytest.raises(OSError, match="disk full"):
        save_random_checkpoint(out, seed=2, overwrite=True)

    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]


@pytest.mark.parametrize(
    "size, expected",
    [(5_000, 5_000), ("5GB", 5 * 10**9), ("500MiB", 500 * 2**20), ("1.5kb", 1500), ("10 KiB", 10240), ("77", 77)],
)
def test_parse_shard_size(size, expected):
    assert parse_shard_size(size) == expected


@pytest.mark.parametrize("size", ["", "5 parsecs", "GB", 0, -3, "0MB", True])
def test_parse_shard_size_rejects(size):
    with pytest.raises(UserError, match="max_shard_size"):
        parse_shard_size(size)


def test_copy_tokenizer_files_copies_only_known_files(tmp_path):
    src, dst = tmp_path / "src", tmp_path / "dst"
    src.mkdir()
    dst.mkdir()
    (src / "tokenizer.json").write_text('{"a": 1}')
    (src / "generation_config.json").write_text('{"b": 2}')
    (src / "model.safetensors").write_text("not a tokenizer file")

    copied = copy_tokenizer_files(src, dst)

    assert sorted(p.name for p in copied) == ["generation_config.json", "tokenizer.json"]
    assert sorted(os.listdir(dst)) == ["generation_config.json", "tokenizer.json"]
    assert (dst / "tokenizer.json").read_text() == '{"a": 1}'


@pytest.mark.parametrize(
    "config_template, written",
    [
        (None, True),  # the tokenizer had none: the config named one
        ("{{ 'other' }}", True),  # the config replaced the tokenizer's own
        ("{{ 'used' }}", False),  # the tokenizer's own: copied as it is
        ([{"name": "default", "template": "{{ 'used' }}"}, {"name": "tool_use", "template": "x"}], False),
    ],
)
def test_copy_tokenizer_files_saves_the_chat_template_used(tmp_path, config_template, written):
    src, dst = tmp_path / "src", tmp_path / "dst"
    src.mkdir()
    dst.mkdir()
    config = {"eos_token": "e"} if config_template is None else {"eos_token": "e", "chat_template": config_template}
    (src / "tokenizer_config.json").write_text(json.dumps(config))

    copy_tokenizer_files(src, dst, chat_template="{{ 'used' }}")

    saved = json.loads((dst / "tokenizer_config.json").read_text())
    assert (dst / "chat_template.jinja").exists() is written
    if written:
        assert (dst / "chat_template.jinja").read_text() == "{{ 'used' }}"
        assert saved == {"eos_token": "e"}  # nothing left that says otherwise
    else:
        assert saved == config


def test_copy_tokenizer_files_missing_source(tmp_path):
    with pytest.raises(UserError, match="nowhere"):
        copy_tokenizer_files(tmp_path / "nowhere", tmp_path)


def test_save_hf_includes_tokenizer_files(tmp_path):
    (tmp_path / "tok").mkdir()
    (tmp_path / "tok" / "tokenizer_config.json").write_text("{}")
    out = save_random_checkpoint(tmp_path / "out", tokenizer_dir=tmp_path / "tok")
    assert (out / "tokenizer_config.json").read_text() == "{}"
