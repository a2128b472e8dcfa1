"""Config files and Hydra overrides: each grammar form, and each way a file or override can be wrong."""

import pytest

from torchtune_ac.config import load_config, resolve_config_path
from torchtune_ac.errors import UserError
from torchtune_ac.registry import builtin_config_names, configs_dir

BASE = """\
output_dir: /tmp/out
batch_size: 2
optimizer:
  _component_: torch.optim.AdamW
  lr: 2.0e-5
layers: [1, 2]
lr_copy: ${optimizer.lr}
"""


@pytest.fixture
def config_file(tmp_path):
    path = tmp_path / "base.yaml"
    path.write_text(BASE)
    return path


@pytest.mark.parametrize(
    "overrides, check",
    [
        (["batch_size=8"], lambda c: c.batch_size == 8),
        (["optimizer.lr=1e-4"], lambda c: c.optimizer.lr == 1e-4 and c.lr_copy == 1e-4),
        (["+new.key=3"], lambda c: c.new.key == 3),
        (["~layers"], lambda c: "layers" not in c),
        (["layers=[3,4,5]"], lambda c: list(c.layers) == [3, 4, 5]),
        (["ac_mode=selective", "ac_option=2"], lambda c: c.ac_mode == "selective" and c.ac_option == 2),
        (["output_dir=null"], lambda c: c.output_dir is None),
        (["++batch_size=5"], lambda c: c.batch_size == 5),
        (["ac_option='2'"], lambda c: c.ac_option == "2"),
    ],
)
def test_override_grammar(config_file, overrides, check):
    cfg = load_config(str(config_file), overrides)
    assert check(cfg)


def test_interpolations_are_resolved(config_file):
    cfg = load_config(str(config_file), [])
    assert cfg.lr_copy == 2e-5


def test_builtin_names_resolve_to_files():
    for name in builtin_config_names():
        path = resolve_config_path(name)
        assert path == configs_dir() / f"{name}.yaml"
        assert path.is_file(), name


def test_a_source_checkout_uses_its_own_configs_and_recipes(monkeypatch, tmp_path):
    """An editable install of another checkout (a second git worktree) maps ``torchtune_ac._configs`` to that
    checkout's folders; this checkout's code must still run its own recipe and configs."""
    from importlib.machinery import ModuleSpec
    from pathlib import Path

    from torchtune_ac import registry

    def other_checkout(name, *args):
        spec = ModuleSpec(name, loader=None, is_package=True)
        spec.submodule_search_locations = [str(tmp_path / name)]
        return spec

    monkeypatch.setattr(registry.importlib.util, "find_spec", other_checkout)
    checkout = Path(registry.__file__).resolve().parent.parent
    assert registry.configs_dir() == checkout / "configs"
    assert registry.recipes_dir() == checkout / "recipes"


@pytest.mark.parametrize(
    "text, overrides, expected",
    [
        (BASE, ["batch_size=[1"], "malformed override 'batch_size=[1'"),
        (BASE, ["batch_size"], "malformed override 'batch_size'"),
        (BASE, ["x==1"], "malformed override 'x==1'"),
        (BASE, ["~nokey"], "'nokey' does not exist"),
        (BASE, ["+batch_size=3"], "already at 'batch_size'"),
        ("a: [1,\n b: 2\n", [], "invalid YAML"),
        ("a: 1\na: 2\n", [], "duplicate key a"),
        ("- 1\n- 2\n", [], "expected a mapping of keys to values at the top level"),
        ("a: ${nope}\n", [], "cannot resolve"),
    ],
)
def test_load_errors_name_the_problem(tmp_path, text, overrides, expected):
    path = tmp_path / "c.yaml"
    path.write_text(text)
    with pytest.raises(UserError, match=None) as info:
        load_config(str(path), overrides)
    assert expected in str(info.value)
    assert "\n" not in str(info.value)


@pytest.mark.parametrize(
    "override, quoted",
    [("output_dir=/tmp/ä", "output_dir='/tmp/ä'"), ("output_dir=/data/naïve's run", "output_dir=\"/data/naïve's run\"")],
)
def test_an_unquoted_non_ascii_value_is_refused_with_how_to_quote_it(config_file, override, quoted):
    """Hydra only said "token recognition error at: 'ä'"."""
    with pytest.raises(UserError) as info:
        load_config(str(config_file), [override])
    first = next(c for c in override if not c.isascii())
    assert f"token recognition error at: '{first}'" in str(info.value)
    assert f"a value with non-ASCII characters must be quoted: {quoted}" in str(info.value)
    assert load_config(str(config_file), [quoted]).output_dir == override.split("=", 1)[1]


@pytest.mark.parametrize(
    "name, expected",
    [
        ("llama3/8B_ful", "did you mean llama3/8B_full?"),
        ("nowhere/missing.yaml", "no such file"),
        ("nothing_like_it", "not a file and not a built-in config"),
    ],
)
def test_unknown_config(name, expected):
    with pytest.raises(UserError) as info:
        resolve_config_path(name)
    assert expected in str(info.value)


def test_config_must_be_yaml(tmp_path):
    path = tmp_path / "c.txt"
    path.write_text("a: 1\n")
    with pytest.raises(UserError, match="expected a .yaml or .yml file"):
        resolve_config_path(str(path))


@pytest.mark.parametrize(
    "text, overrides",
    [
        (BASE + "hydra:\n  searchpath: [pkg://this]\n", []),  # pkg:// would import the package `this`
        (BASE, ["hydra.searchpath=[pkg://this]"]),
        (BASE, ["+hydra.searchpath=[pkg://this]"]),
        (BASE, ["hydra/job_logging=disabled"]),
    ],
)
def test_hydra_settings_are_refused_before_anything_is_imported(tmp_path, text, overrides, capsys):
    import sys

    path = tmp_path / "c.yaml"
    path.write_text(text)
    sys.modules.pop("this", None)
    with pytest.raises(UserError, match="hydra|Hydra"):
        load_config(str(path), overrides)
    assert "this" not in sys.modules
    assert "Zen of Python" not in capsys.readouterr().out


def test_a_folder_beside_the_yaml_does_not_capture_an_override(tmp_path):
    """Hydra would read a folder next to the YAML as a config group and refuse `checkpoint_dir=...`."""
    path = tmp_path / "c.yaml"
    path.write_text(BASE)
    (tmp_path / "checkpoint_dir").mkdir()
    (tmp_path / "checkpoint_dir" / "x.yaml").write_text("a: 1\n")
    cfg = load_config(str(path), ["checkpoint_dir=/models/x"])
    assert cfg.checkpoint_dir == "/models/x"
