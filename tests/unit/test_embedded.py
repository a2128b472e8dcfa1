"""The embedded tiny checkpoint: deterministic bytes, complete contents, created only when needed."""

import hashlib
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from models_testlib import assert_same_state, clone_state
from numerics import assert_close, llama_terms
from tokenizers import Tokenizer, models
from transformers import AutoModelForCausalLM

from torchtune_ac.checkpoint import WEIGHTS_FILE, read_hf_config
from torchtune_ac.data import EMBEDDED_TOKENIZER_DIR
from torchtune_ac.embedded import ensure_embedded_checkpoint, resolve_cache_dir
from torchtune_ac.models import llama_tiny, load_hf

REPO = Path(__file__).resolve().parents[2]
SPECIALS = ["<|begin_of_text|>", "<|end_of_text|>", "<|pad|>"]


def write_tokenizer(directory: Path, n_tokens: int = 512) -> Path:
    """A throwaway word-level tokenizer with ``n_tokens`` tokens, the last three special."""
    directory.mkdir(parents=True, exist_ok=True)
    vocab = {f"w{i}": i for i in range(n_tokens - len(SPECIALS))}
    vocab.update({token: len(vocab) + i for i, token in enumerate(SPECIALS)})
    Tokenizer(models.WordLevel(vocab, unk_token="w0")).save(str(directory / "tokenizer.json"))
    config = {"bos_token": SPECIALS[0], "eos_token": {"content": SPECIALS[1]}, "pad_token": SPECIALS[2]}
    (directory / "tokenizer_config.json").write_text(json.dumps(config))
    return directory


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory):
    return write_tokenizer(tmp_path_factory.mktemp("tokenizer"))


def test_bytes_are_deterministic_and_rng_is_untouched(tmp_path, tokenizer_dir):
    torch.manual_seed(123)
    rng_before = torch.get_rng_state()

    first = ensure_embedded_checkpoint(tmp_path / "a", tokenizer_dir=tokenizer_dir)
    second = ensure_embedded_checkpoint(tmp_path / "b", tokenizer_dir=tokenizer_dir)
    first_hash = sha256(first / WEIGHTS_FILE)
    ensure_embedded_checkpoint(tmp_path / "a", tokenizer_dir=tokenizer_dir, force=True)

    assert first == tmp_path / "a" / "tiny-llama-v1"
    assert sha256(second / WEIGHTS_FILE) == first_hash
    assert sha256(first / WEIGHTS_FILE) == first_hash
    assert (first / "config.json").read_bytes() == (second / "config.json").read_bytes()
    assert torch.equal(torch.get_rng_state(), rng_before)


def test_contents_weights_and_special_ids(tmp_path, tokenizer_dir):
    path = ensure_embedded_checkpoint(tmp_path, tokenizer_dir=tokenizer_dir)

    assert sorted(p.name for p in path.iterdir()) == [
        "config.json", WEIGHTS_FILE, "tokenizer.json", "tokenizer_config.json"]
    config = read_hf_config(path)
    assert (config["bos_token_id"], config["eos_token_id"], config["pad_token_id"]) == (509, 510, 511)
    assert config["dtype"] == "float32"
    torch.manual_seed(0)
    expected = llama_tiny()
    expected.init_weights(0.02)
    loaded = load_hf(path)
    assert sum(p.numel() for p in loaded.parameters()) == 1_607_808
    assert_same_state(clone_state(loaded), clone_state(expected))


@pytest.mark.numerics
def test_loads_in_transformers_with_same_logits(tmp_path, tokenizer_dir):
    path = ensure_embedded_checkpoint(tmp_path, tokenizer_dir=tokenizer_dir)
    tokens = torch.randint(0, 512, (2, 32), generator=torch.Generator().manual_seed(0))

    hf_model = AutoModelForCausalLM.from_pretrained(path, attn_implementation="eager").eval()
    ours = load_hf(path).eval()
    with torch.no_grad():
        # transformers adds in other orders (other attention kernels, RoPE and norm formulas): within rounding.
        assert_close(hf_model(tokens).logits, ours(tokens), terms=llama_terms(ours.args, 32, 0, backward=False),
                     what="logits")


def test_complete_checkpoint_is_reused_and_incomplete_one_rebuilt(tmp_path, tokenizer_dir):
    path = ensure_embedded_checkpoint(tmp_path, tokenizer_dir=tokenizer_dir)
    weights = path / WEIGHTS_FILE
    expected_hash = sha256(weights)
    inode = weights.stat().st_ino

    assert ensure_embedded_checkpoint(tmp_path, tokenizer_dir=tokenizer_dir) == path
    assert weights.stat().st_ino == inode  # not rewritten

    weights.unlink()
    ensure_embedded_checkpoint(tmp_path, tokenizer_dir=tokenizer_dir)
    assert sha256(weights) == expected_hash


def test_missing_tokenizer_is_reported(tmp_path):
    with pytest.raises(FileNotFoundError, match="tokenizer.json"):
        ensure_embedded_checkpoint(tmp_path / "cache", tokenizer_dir=tmp_path / "empty")
    assert not (tmp_path / "cache" / "tiny-llama-v1").exists()


def test_tokenizer_of_wrong_size_is_refused(tmp_path):
    with pytest.raises(RuntimeError, match="500 tokens"):
        ensure_embedded_checkpoint(tmp_path / "cache", tokenizer_dir=write_tokenizer(tmp_path / "tok", 500))


@pytest.mark.parametrize(
    "argument, env, expected",
    [("/x/given", "/x/env", "/x/given"), (None, "/x/env", "/x/env"), (None, None, "HOME/.cache/torchtune_ac")],
)
def test_cache_dir_resolution(monkeypatch, tmp_path, argument, env, expected):
    monkeypatch.setenv("HOME", str(tmp_path))
    if env is None:
        monkeypatch.delenv("TORCHTUNE_AC_CACHE", raising=False)
    else:
        monkeypatch.setenv("TORCHTUNE_AC_CACHE", env)
    assert resolve_cache_dir(argument) == Path(expected.replace("HOME", str(tmp_path)))


@pytest.mark.skipif(
    not (Path(EMBEDDED_TOKENIZER_DIR) / "tokenizer.json").is_file(), reason="embedded tokenizer not generated yet"
)
def test_script_with_packaged_tokenizer(tmp_path):
    result = subprocess.run(
        [sys.executable, str(REPO / "scripts" / "make_tiny_checkpoint.py"), "--out", str(tmp_path)],
        capture_output=True, text=True, cwd=REPO, env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin"},
        check=True,
    )
    lines = result.stdout.splitlines()
    assert lines[0] == str(tmp_path / "tiny-llama-v1")
    assert lines[1] == "parameters: 1,607,808"
    assert lines[2].endswith(sha256(tmp_path / "tiny-llama-v1" / WEIGHTS_FILE))
