"""The package's layers, checked on its import statements: each package imports only the packages below it.

    cli, recipes
    generate    (tune generate: transformers' generation over a checkpoint a run wrote)
    config      (schema, loading, components, start-up checks)
    training    (AC, sharding, step, loss, model setup)
    checkpoint  (files, safetensors, Hugging Face load/save, recipe state)
    models, data
    errors, component_marker

``embedded`` (the maker of the embedded checkpoint) needs models, data and checkpoint, and sits above them;
``migrate`` (torchtune configs to ours) is a pure mapping that config uses to recognise a torchtune config.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "torchtune_ac"
LEAVES = {"errors", "component_marker"}
# package -> the torchtune_ac packages (first component after torchtune_ac.) it may import
ALLOWED = {
    "models": LEAVES,
    "data": LEAVES,
    "checkpoint": LEAVES | {"models"},
    "training": LEAVES | {"models", "checkpoint"},
    "embedded": LEAVES | {"models", "data", "checkpoint"},
    "migrate": LEAVES,
    "generate": LEAVES | {"checkpoint", "data"},
    "config": LEAVES | {"models", "data", "checkpoint", "training", "registry", "embedded", "migrate"},
}
# The one way up: torchtune_ac.models.load_hf / save_hf / from_hf_config are contract names, re-exported from
# the checkpoint package on first use (a module __getattr__), not at import.
EXCEPTIONS = {"models/__init__.py": {"checkpoint"}}


def imported_modules(path: Path) -> list[str]:
    """Every module an ``import`` statement of the file names (function-level imports included)."""
    names = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.append(node.module)
    return names


def torchtune_ac_imports(package: str) -> dict[str, set[str]]:
    """file -> the torchtune_ac packages it imports (other than its own)."""
    root = PACKAGE / package
    files = sorted(root.rglob("*.py")) if root.is_dir() else [PACKAGE / f"{package}.py"]
    found = {}
    for path in files:
        targets = {
            name.split(".")[1]
            for name in imported_modules(path)
            if name.startswith("torchtune_ac.") and name.split(".")[1] != package
        }
        found[str(path.relative_to(PACKAGE))] = targets
    return found


@pytest.mark.parametrize("package", sorted(ALLOWED))
def test_each_package_imports_only_the_layers_below_it(package):
    for path, targets in torchtune_ac_imports(package).items():
        allowed = ALLOWED[package] | EXCEPTIONS.get(path, set())
        assert targets <= allowed, f"{path} imports {sorted(targets - allowed)}"


def test_models_hold_no_collectives_and_no_file_system_code():
    for path in sorted((PACKAGE / "models").rglob("*.py")):
        for name in imported_modules(path):
            assert not name.startswith("torch.distributed"), (path, name)
            assert name not in ("os", "pathlib", "shutil", "json", "safetensors"), (path, name)


def test_the_test_can_fail(tmp_path, monkeypatch):
    (tmp_path / "models").mkdir()
    (tmp_path / "models" / "bad.py").write_text("from torchtune_ac.training.step import train_step\n")
    monkeypatch.setattr(__import__(__name__), "PACKAGE", tmp_path)
    assert torchtune_ac_imports("models") == {"models/bad.py": {"training"}}
