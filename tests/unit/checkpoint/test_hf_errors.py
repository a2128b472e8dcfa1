"""Bad checkpoints: every case is a UserError naming the file / tensor, raised before the model is touched."""

import dataclasses
import json

import pytest
import torch
from models_testlib import TINY, assert_same_state, build_random_llama, clone_state, save_random_checkpoint
from safetensors.torch import load_file, save_file

from torchtune_ac.checkpoint import INDEX_FILE, WEIGHTS_FILE
from torchtune_ac.errors import UserError
from torchtune_ac.models import Llama, load_hf, load_hf_weights_

TIED = dataclasses.replace(TINY, tie_embeddings=True)


def edit_tensors(ckpt, edit):
    tensors = load_file(ckpt / WEIGHTS_FILE)
    edit(tensors)
    save_file(tensors, ckpt / WEIGHTS_FILE, metadata={"format": "pt"})
    return ckpt


def edit_json(path, edit):
    data = json.loads(path.read_text())
    edit(data)
    path.write_text(json.dumps(data))


def missing_dir(tmp_path):
    return tmp_path / "nope"


def missing_config(tmp_path):
    ckpt = save_random_checkpoint(tmp_path / "c")
    (ckpt / "config.json").unlink()
    return ckpt


def config_not_json(tmp_path):
    ckpt = save_random_checkpoint(tmp_path / "c")
    (ckpt / "config.json").write_text('{\n  "model_type": "llama",\n  oops\n}')
    return ckpt


def config_not_object(tmp_path):
    ckpt = save_random_checkpoint(tmp_path / "c")
    (ckpt / "config.json").write_text("[1, 2]")
    return ckpt


def config_unsupported(tmp_path):
    ckpt = save_random_checkpoint(tmp_path / "c")
    edit_json(ckpt / "config.json", lambda c: c.update(mlp_bias=True, hidden_act="gelu"))
    return ckpt


def config_unknown_family(tmp_path):
    ckpt = save_random_checkpoint(tmp_path / "c")
    edit_json(ckpt / "config.json", lambda c: c.update(model_type="gpt2"))
    return ckpt


def config_rope_differs(tmp_path):
    ckpt = save_random_checkpoint(tmp_path / "c")
    edit_json(ckpt / "config.json", lambda c: c.update(rope_theta=1234.0))
    return ckpt


def no_weights(tmp_path):
    ckpt = save_random_checkpoint(tmp_path / "c")
    (ckpt / WEIGHTS_FILE).unlink()
    return ckpt


def pickle_only(tmp_path):
    ckpt = no_weights(tmp_path)
    (ckpt / "pytorch_model.bin").write_bytes(b"\x80\x04pickled")
    return ckpt


def truncated(tmp_path):
    ckpt = save_random_checkpoint(tmp_path / "c")
    data = (ckpt / WEIGHTS_FILE).read_bytes()
    (ckpt / WEIGHTS_FILE).write_bytes(data[:-100])
    return ckpt


def corrupt_header(tmp_path):
    ckpt = save_random_checkpoint(tmp_path / "c")
    data = (ckpt / WEIGHTS_FILE).read_bytes()
    (ckpt / WEIGHTS_FILE).write_bytes(data[:8] + b"#" * 16 + data[24:])
    return ckpt


def sharded(tmp_path):
    return save_random_checkpoint(tmp_path / "c", max_shard_size=13_000)


def index_missing_shard(tmp_path):
    ckpt = sharded(tmp_path)
    next(ckpt.glob("model-00002-of-*.safetensors")).unlink()
    return ckpt


def index_not_json(tmp_path):
    ckpt = sharded(tmp_path)
    (ckpt / INDEX_FILE).write_text('{"weight_map": ')
    return ckpt


def index_points_to_wrong_shard(tmp_path):
    ckpt = sharded(tmp_path)
    first = sorted(ckpt.glob("model-*.safetensors"))[0].name
    edit_json(ckpt / INDEX_FILE, lambda i: i["weight_map"].update({"model.norm.weight": first}))
    return ckpt


def missing_tensor(tmp_path):
    return edit_tensors(save_random_checkpoint(tmp_path / "c"), lambda t: t.pop("model.layers.1.mlp.up_proj.weight"))


def unexpected_tensor(tmp_path):
    def add(tensors):
        tensors["model.layers.2.mlp.up_proj.weight"] = torch.zeros(64, 32)

    return edit_tensors(save_random_checkpoint(tmp_path / "c"), add)


def shape_mismatch(tmp_path):
    def widen(tensors):
        tensors["model.layers.0.self_attn.k_proj.weight"] = torch.zeros(32, 32)

    return edit_tensors(save_random_checkpoint(tmp_path / "c"), widen)


def integer_dtype(tmp_path):
    def to_int(tensors):
        tensors["model.norm.weight"] = torch.ones(32, dtype=torch.int64)

    return edit_tensors(save_random_checkpoint(tmp_path / "c"), to_int)


def tied_head_differs(tmp_path):
    def add_head(tensors):
        tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"] + 1.0

    return edit_tensors(save_random_checkpoint(tmp_path / "c", args=TIED), add_head)


# (case, model args, substrings the one-line message must contain)
CASES = [
    (missing_dir, TINY, ["nope", "does not exist"]),
    (missing_config, TINY, ["config.json", "missing"]),
    (config_not_json, TINY, ["config.json", "line 3", "not valid JSON"]),
    (config_not_object, TINY, ["config.json", "JSON object"]),
    (config_unsupported, TINY, ["config.json", "mlp_bias=True", "hidden_act='gelu'"]),
    (config_unknown_family, TINY, ["config.json", "model_type='gpt2'", "supported: 'llama'"]),
    (no_weights, TINY, ["no weights", WEIGHTS_FILE, INDEX_FILE]),
    (pickle_only, TINY, ["pytorch_model.bin", "never loaded", "AutoModelForCausalLM.from_pretrained("]),
    (truncated, TINY, [WEIGHTS_FILE, "truncated or corrupt"]),
    (corrupt_header, TINY, [WEIGHTS_FILE, "not a readable safetensors file"]),
    (index_missing_shard, TINY, [INDEX_FILE, "model-00002-of-", "does not exist"]),
    (index_not_json, TINY, [INDEX_FILE, "line 1"]),
    (index_points_to_wrong_shard, TINY, [INDEX_FILE, "model.norm.weight", "model-00001-of-"]),
    (missing_tensor, TINY, ["missing tensor model.layers.1.mlp.up_proj.weight"]),
    (unexpected_tensor, TINY, [WEIGHTS_FILE, "unexpected tensor model.layers.2.mlp.up_proj.weight"]),
    (shape_mismatch, TINY, [WEIGHTS_FILE, "model.layers.0.self_attn.k_proj.weight", "[32, 32]", "[16, 32]"]),
    (integer_dtype, TINY, [WEIGHTS_FILE, "model.norm.weight", "I64"]),
    (tied_head_differs, TIED, [WEIGHTS_FILE, "lm_head.weight", "differs"]),
]


def head_layout_differs(tmp_path):
    # 8 heads of 4 and 4 KV heads of 4: every tensor has the same shape as TINY's 4 heads of 8 and 2 KV heads.
    return save_random_checkpoint(tmp_path / "c", args=dataclasses.replace(TINY, n_heads=8, n_kv_heads=4))


# Only an existing model can disagree with the checkpoint's config (load_hf builds from that config).
EXISTING_MODEL_CASES = CASES + [
    (config_rope_differs, TINY, ["config.json", "rope_theta=1234.0", "10000.0"]),
    (head_layout_differs, TINY, ["config.json", "num_attention_heads=8, model has 4",
                                 "num_key_value_heads=4, model has 2", "head_dim=4, model has 8"]),
]


@pytest.mark.parametrize("make, args, expected", CASES, ids=[case[0].__name__ for case in CASES])
def test_load_hf_rejects_bad_checkpoint(tmp_path, make, args, expected):
    ckpt = make(tmp_path)
    with pytest.raises(UserError) as info:
        load_hf(ckpt)
    message = str(info.value)
    assert "\n" not in message
    for part in expected:
        assert part in message


@pytest.mark.parametrize(
    "make, args, expected", EXISTING_MODEL_CASES, ids=[case[0].__name__ for case in EXISTING_MODEL_CASES]
)
def test_failed_load_leaves_model_unchanged(tmp_path, make, args, expected):
    ckpt = make(tmp_path)
    model = build_random_llama(args, seed=99)
    before = clone_state(model)

    with pytest.raises(UserError) as info:
        load_hf_weights_(model, ckpt)

    for part in expected:
        assert part in str(info.value)
    assert_same_state(clone_state(model), before)


def test_tied_checkpoint_may_carry_equal_lm_head(tmp_path):
    ckpt = edit_tensors(
        save_random_checkpoint(tmp_path / "c", args=TIED, seed=3),
        lambda t: t.update({"lm_head.weight": t["model.embed_tokens.weight"].clone()}),
    )
    model = load_hf(ckpt)
    assert model.output.weight is model.tok_embeddings.weight
    assert_same_state(clone_state(model), clone_state(build_random_llama(TIED, seed=3)))


def test_legacy_rotary_inv_freq_buffers_are_ignored(tmp_path):
    ckpt = edit_tensors(
        save_random_checkpoint(tmp_path / "c", seed=4),
        lambda t: t.update({"model.layers.0.self_attn.rotary_emb.inv_freq": torch.ones(4)}),
    )
    assert_same_state(clone_state(load_hf(ckpt)), clone_state(build_random_llama(TINY, seed=4)))


def test_model_untied_by_to_empty_is_refused(tmp_path):
    ckpt = save_random_checkpoint(tmp_path / "c", args=TIED)
    with torch.device("meta"):
        model = Llama(TIED)
    model.to_empty(device="cpu")  # gives output.weight its own tensor

    with pytest.raises(ValueError, match="to_empty"):
        load_hf_weights_(model, ckpt)


def test_model_on_meta_is_refused(tmp_path):
    ckpt = save_random_checkpoint(tmp_path / "c")
    with torch.device("meta"):
        model = Llama(TINY)
    with pytest.raises(ValueError, match="meta"):
        load_hf_weights_(model, ckpt)
