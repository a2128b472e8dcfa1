"""The package's layers, checked on its import statements: each package imports only the packages below it.

    cli, recipes
    generate      (tune generate: transformers' generation over a checkpoint a run wrote)
    run           (the run's plan resolved once, the one order that applies it, the loop; stop and resume messages)
    config        (schema, loading, components, the meta model)
    lora          (low-rank adapters: the adapter: keys, the wrapped linears, PEFT's names, the merged export)
    memory        (the memory features, each with its mechanism, listed once; the memory plan and the planner)
    training      (the step, the objectives, evaluation, LR schedules)
    generation    (the KV cache, sampling, batched decoding: the GRPO recipe's rollouts)
    activation_checkpointing   (AC's keys and their validation, its plan, policy and mechanism)
    parallel      (the mechanisms that split a model over the processes: tensor parallelism, FSDP2)
    models        (the decoder, the families and their pure adapters; Hugging Face checkpoints of any family)
    checkpoint    (files, safetensors, recipe state; the run's process context passed in)
    runtime       (launcher, the process context and its collectives, the parallelism value and its device mesh,
                  stop signals, rank agreement)
    data, observability   (datasets; metrics.jsonl, trackers)
    errors, component_marker, config_key

``embedded`` (the maker of the embedded checkpoint) needs models, data and checkpoint, and sits above them;
``compat/torchtune`` (``tune migrate``, torchtune's component paths) is what exists only for torchtune's users: a
pure mapping above config (whose key tables it derives from the schema and the families), and one table of paths
that config's component loader reads (``paths.py``, which imports nothing).

Within ``models``, one module composes the families' adapters with checkpoint's file code
(``models/hf_checkpoint.py``) and the package exports it; the other model files import from ``checkpoint`` only its
pure vocabulary of stored layouts (``layout.py``, and the MXFP4 decoder), in which a family declares its storage.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "torchtune_ac"
LEAVES = {"errors", "component_marker", "config_key"}
# package -> the torchtune_ac packages (first component after torchtune_ac.) it may import
ALLOWED = {
    "runtime": LEAVES,
    "data": LEAVES,
    "observability": LEAVES,
    "checkpoint": LEAVES | {"runtime"},
    "models": LEAVES | {"checkpoint"},
    "parallel": LEAVES | {"models", "runtime"},
    "activation_checkpointing": LEAVES | {"models"},
    "training": LEAVES | {"models", "runtime", "parallel", "activation_checkpointing", "generation"},
    "memory": LEAVES | {"models", "runtime", "parallel", "activation_checkpointing", "training"},
    "embedded": LEAVES | {"models", "data", "checkpoint"},
    "lora": LEAVES | {"models", "checkpoint", "runtime", "training"},
    "compat": LEAVES | {"config", "memory", "models", "parallel", "runtime", "activation_checkpointing", "training"},
    "config": LEAVES | {"models", "data", "checkpoint", "runtime", "parallel", "activation_checkpointing", "training",
                        "memory", "observability", "registry", "embedded", "lora"},
    "run": LEAVES | {"models", "data", "checkpoint", "runtime", "parallel", "activation_checkpointing", "training",
                     "memory", "observability", "config", "lora", "generation"},  # generation: GRPO's rollouts
    "generate": LEAVES | {"checkpoint", "data", "models"},
    "generation": LEAVES | {"models"},
}
# The component loader reads torchtune's mirrored paths from compat's table (which imports nothing of ours).
EXCEPTIONS = {
    "config/components.py": {"compat"},
}
# The model files that may import checkpoint: the one composing module, and the package that exports it.
MODELS_USING_CHECKPOINT = {"models/hf_checkpoint.py", "models/__init__.py"}
# What any model file may import from checkpoint: the pure vocabulary a family declares its storage in.
STORAGE_VOCABULARY = {"torchtune_ac.checkpoint.layout", "torchtune_ac.checkpoint.mxfp4"}


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


def test_only_the_hugging_face_module_of_models_knows_checkpointing():
    for path in sorted((PACKAGE / "models").rglob("*.py")):
        if str(path.relative_to(PACKAGE)) in MODELS_USING_CHECKPOINT:
            continue
        for name in imported_modules(path):
            assert not name.startswith("torchtune_ac.checkpoint") or name in STORAGE_VOCABULARY, (path, name)


def test_the_storage_vocabulary_holds_no_file_code():
    """What model files may import from checkpoint reads and writes nothing: no file, no collective."""
    for module in sorted(STORAGE_VOCABULARY):
        path = PACKAGE.parent / (module.replace(".", "/") + ".py")
        for name in imported_modules(path):
            assert not name.startswith("torch.distributed") and name.split(".")[0] not in (
                "os", "shutil", "json", "safetensors"), (path, name)
            assert not name.startswith("torchtune_ac.") or name in STORAGE_VOCABULARY, (path, name)


def test_models_define_no_module_getattr():
    """Every name of ``torchtune_ac.models`` exists at import: no lazy re-export through a module ``__getattr__``."""
    for path in sorted((PACKAGE / "models").rglob("*.py")):
        functions = {node.name for node in ast.parse(path.read_text()).body if isinstance(node, ast.FunctionDef)}
        assert "__getattr__" not in functions, path


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


def module_graph(package: Path) -> dict[str, set[str]]:
    """module -> the modules of ``package`` it imports, by dotted name, from every ``import`` statement: at module
    level, in a function, under ``TYPE_CHECKING`` alike (an import moved out of sight is still an edge). ``from a
    import b`` names the module ``a.b`` where there is one, else ``a``."""
    def name_of(path: Path) -> str:
        parts = path.relative_to(package.parent).with_suffix("").parts
        return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)

    files = {name_of(path): path for path in sorted(package.rglob("*.py"))}
    graph = {}
    for module, path in files.items():
        here = module if path.name == "__init__.py" else module.rpartition(".")[0]
        edges = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                edges |= {alias.name for alias in node.names}
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    anchor = here.split(".")[:len(here.split(".")) - node.level + 1]
                    base = ".".join(anchor + ([base] if base else []))
                edges |= {f"{base}.{alias.name}" if f"{base}.{alias.name}" in files else base for alias in node.names}
        graph[module] = {edge for edge in edges if edge in files and edge != module}
    return graph


def import_circle(graph: dict[str, set[str]]) -> list[str]:
    """One circle of imports in ``graph``, as the modules around it (the first again at the end); [] if none."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(module: str) -> list[str]:
        state[module] = 1
        path.append(module)
        for target in sorted(graph[module]):
            if state.get(target) == 1:
                return path[path.index(target):] + [target]
            if target not in state and (circle := visit(target)):
                return circle
        path.pop()
        state[module] = 2
        return []

    for module in sorted(graph):
        if module not in state and (circle := visit(module)):
            return circle
    return []


def test_no_module_imports_itself_through_others():
    """No circle of imports anywhere in the package, not even one held apart by an import inside a function or
    under ``TYPE_CHECKING``: any runtime use of such an edge fails at import. A name two modules share moves down
    to a module both import."""
    assert import_circle(module_graph(PACKAGE)) == []


def test_a_circle_hidden_under_type_checking_is_found(tmp_path):
    package = tmp_path / "pkg"
    (package / "sub").mkdir(parents=True)
    for path in (package / "__init__.py", package / "sub" / "__init__.py"):
        path.write_text("")
    (package / "sub" / "a.py").write_text("from pkg.sub.b import B\n")
    (package / "sub" / "b.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .a import A\n")
    (package / "c.py").write_text("def f():\n    from pkg.sub import a\n")
    assert module_graph(package)["pkg.c"] == {"pkg.sub.a"}
    assert import_circle(module_graph(package)) == ["pkg.sub.a", "pkg.sub.b", "pkg.sub.a"]


def test_compat_s_path_table_imports_nothing_of_ours():
    assert torchtune_ac_imports("compat")["compat/torchtune/paths.py"] == set()


def _source_files() -> list[Path]:
    return sorted(PACKAGE.rglob("*.py"))


def test_keys_and_features_are_written_down_not_discovered():
    """No class made at import time from others' fields, no module found by walking a package."""
    for path in _source_files():
        text = path.read_text()
        assert "make_dataclass" not in text and "pkgutil" not in text, path


def test_which_process_this_is_is_answered_by_the_one_context():
    """The launcher's environment (RANK, WORLD_SIZE) is read in runtime/ alone; the process group is joined once
    (``run/session.py``); there is one barrier (``runtime/distributed.py``'s) and one ``FSDPConfig``."""
    joins, barriers, fsdp_configs = [], [], []
    for path in _source_files():
        relative = str(path.relative_to(PACKAGE))
        text = path.read_text()
        if not relative.startswith("runtime/"):
            assert '"RANK"' not in text and '"WORLD_SIZE"' not in text, relative
        if "init_distributed(" in text and "def init_distributed(" not in text:
            joins.append(relative)
        if "all_reduce(torch.zeros(1))" in text:
            barriers.append(relative)
        if "class FSDPConfig" in text:
            fsdp_configs.append(relative)
    assert joins == ["run/session.py"] and barriers == ["runtime/distributed.py"]
    assert fsdp_configs == ["parallel/fsdp.py"]


def test_the_parallelism_is_decided_once_and_held_once():
    """The degrees are checked against the world size in one place (``Parallelism``), the config's
    ``tensor_parallel_dim`` and ``expert_parallel_dim`` each become a degree in one place (``resolve_parallelism``),
    and nothing asks torch for the world size or a rank but the one function that describes an initialised group
    (``process_group_context``)."""
    checks, asks = [], []
    reads: dict[str, list[str]] = {"cfg.tensor_parallel_dim": [], "cfg.expert_parallel_dim": []}
    for path in _source_files():
        relative = str(path.relative_to(PACKAGE))
        text = path.read_text()
        if re.search(r"world_size\s*%\s*\(", text):
            checks.append(relative)
        for key, readers in reads.items():
            readers += [relative] * text.count(key)
        asks += [relative] * len(re.findall(r"dist\.get_(?:world_size|rank)\(", text))
    assert checks == ["runtime/parallelism.py"]
    assert reads == {"cfg.tensor_parallel_dim": ["run/plan.py"], "cfg.expert_parallel_dim": ["run/plan.py"]}
    assert asks == ["runtime/distributed.py", "runtime/distributed.py"]
