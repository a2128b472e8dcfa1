"""The manifest that ends each checkpoint: what it records, what a check of it catches (each problem named by
file), and how the hashing is dealt out between ranks."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Callable

import pytest

from torchtune_ac.checkpoint.manifest import (
    MANIFEST_FILE,
    _share,
    check_against_manifest,
    hash_file,
    write_manifest,
    write_manifest_without,
)


def _checkpoint(root: Path) -> Path:
    (root / "recipe_state").mkdir(parents=True)
    (root / "config.json").write_text('{"a": 1}\n')
    (root / "model.safetensors").write_bytes(bytes(range(256)) * 4000)
    (root / "recipe_state" / "trainer_state.json").write_text('{"progress": {}}\n')
    (root / "recipe_state" / "__0_0.distcp").write_bytes(b"\x01" * 5000)
    write_manifest(root)
    return root


def test_the_manifest_lists_every_other_file_with_its_size_and_sha256(tmp_path):
    root = _checkpoint(tmp_path / "step_0000002")
    manifest = json.loads((root / MANIFEST_FILE).read_text())
    assert manifest["algorithm"] == "sha256"
    files = manifest["files"]
    assert sorted(files) == ["config.json", "model.safetensors", "recipe_state/__0_0.distcp",
                             "recipe_state/trainer_state.json"]
    data = (root / "model.safetensors").read_bytes()
    assert files["model.safetensors"] == {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    assert check_against_manifest(root, hashes=True, require="recipe_state/trainer_state.json") is None


def test_hash_file_reads_in_chunks_like_one_read(tmp_path):
    path = tmp_path / "big"
    path.write_bytes(b"x" * (9 << 20) + b"tail")  # more than two 4 MiB chunks
    assert hash_file(path) == hashlib.sha256(path.read_bytes()).hexdigest()


def _truncate(root: Path) -> None:
    path = root / "recipe_state" / "trainer_state.json"
    path.write_bytes(path.read_bytes()[:5])


def _flip_a_byte(root: Path) -> None:
    path = root / "recipe_state" / "__0_0.distcp"
    data = bytearray(path.read_bytes())
    data[100] ^= 0xFF
    path.write_bytes(bytes(data))


# damage -> (found by sizes alone, message parts)
DAMAGE: dict[str, tuple[Callable[[Path], None], bool, tuple[str, ...]]] = {
    "missing_distcp": (lambda r: (r / "recipe_state" / "__0_0.distcp").unlink(), True,
                       ("recipe_state/__0_0.distcp", "missing")),
    "truncated_trainer_state": (_truncate, True, ("trainer_state.json", "5 bytes", "truncated")),
    "same_size_other_bytes": (_flip_a_byte, False, ("__0_0.distcp", "SHA-256 differs")),
    "no_manifest": (lambda r: (r / MANIFEST_FILE).unlink(), True, (MANIFEST_FILE, "missing", "did not complete")),
    "garbled_manifest": (lambda r: (r / MANIFEST_FILE).write_text("{not json"), True, (MANIFEST_FILE, "unreadable")),
}


@pytest.mark.parametrize("name", sorted(DAMAGE))
def test_a_damaged_checkpoint_fails_naming_the_file(tmp_path, name):
    damage, by_size, parts = DAMAGE[name]
    root = _checkpoint(tmp_path / "step_0000002")
    damage(root)
    problem = check_against_manifest(root, hashes=True)
    assert problem is not None and all(part in problem for part in parts), problem
    assert "\n" not in problem
    assert (check_against_manifest(root, hashes=False) is not None) == by_size


def test_a_required_file_must_be_listed(tmp_path):
    root = _checkpoint(tmp_path / "step_0000002")
    assert "does not list recipe_state/rng_rank0.pt" in check_against_manifest(
        root, hashes=False, require="recipe_state/rng_rank0.pt")


def test_pruning_rewrites_the_manifest_before_the_files_go(tmp_path):
    root = _checkpoint(tmp_path / "step_0000002")
    write_manifest_without(root, "recipe_state/")
    files = json.loads((root / MANIFEST_FILE).read_text())["files"]
    assert sorted(files) == ["config.json", "model.safetensors"]
    assert check_against_manifest(root, hashes=True) is None  # the extra files it no longer lists are ignored
    assert not list(root.glob(".*tmp"))


@pytest.mark.parametrize("world_size", [1, 2, 3, 8])
def test_hashing_is_dealt_out_once_each_and_balanced_by_size(world_size):
    sizes = {f"f{i}": size for i, size in enumerate([100, 90, 80, 70, 60, 50, 5, 4, 3, 2, 1])}
    shares = [_share(sizes, rank, world_size) for rank in range(world_size)]
    assert sorted(name for share in shares for name in share) == sorted(sizes)
    loads = [sum(sizes[name] for name in share) for share in shares]
    assert max(loads) - min(loads) <= max(sizes.values())
    assert shares == [_share(sizes, rank, world_size) for rank in range(world_size)]  # the same deal every time
