"""The CUDA allocator's default: expandable segments, unless the environment configures the allocator itself; set
by the ``tune`` console script and by each launched process before CUDA is used."""

from __future__ import annotations

import pytest

from torchtune_ac import cli
from torchtune_ac.runtime.allocator import ALLOC_CONF_VARS, DEFAULT_ALLOC_CONF, use_expandable_segments_by_default


def test_expandable_segments_are_the_default_where_nothing_is_configured() -> None:
    env: dict[str, str] = {"PATH": "/bin"}
    assert use_expandable_segments_by_default(env) is True
    assert env == {"PATH": "/bin", "PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}
    assert use_expandable_segments_by_default(env) is False  # once set, it stays as it is


@pytest.mark.parametrize("name", ALLOC_CONF_VARS)
@pytest.mark.parametrize("value", ["expandable_segments:False", "max_split_size_mb:512", ""])
def test_a_configured_allocator_is_left_as_it_is(name: str, value: str) -> None:
    env = {name: value}
    assert use_expandable_segments_by_default(env) is False
    assert env == {name: value}


def _clear(monkeypatch: pytest.MonkeyPatch) -> None:
    # Set, then deleted: monkeypatch records the value before and puts it back (or removes what the command set) at
    # teardown, so the variable the command sets does not stay in the test process for the tests after it.
    for name in ALLOC_CONF_VARS:
        monkeypatch.setenv(name, "")
        monkeypatch.delenv(name)


def test_the_tune_command_sets_it_before_anything_runs(monkeypatch: pytest.MonkeyPatch, capsys) -> None:
    _clear(monkeypatch)
    assert cli.main(["ls"]) == 0
    assert cli.os.environ["PYTORCH_CUDA_ALLOC_CONF"] == DEFAULT_ALLOC_CONF


def test_the_tune_command_keeps_the_users_setting(monkeypatch: pytest.MonkeyPatch, capsys) -> None:
    _clear(monkeypatch)
    monkeypatch.setenv("PYTORCH_ALLOC_CONF", "expandable_segments:False")
    assert cli.main(["ls"]) == 0
    assert "PYTORCH_CUDA_ALLOC_CONF" not in cli.os.environ
    assert cli.os.environ["PYTORCH_ALLOC_CONF"] == "expandable_segments:False"


def test_each_launched_process_sets_it_too(monkeypatch: pytest.MonkeyPatch, capsys) -> None:
    """A process started by torchrun directly, not through ``tune run``, runs ``recipe_main``."""
    _clear(monkeypatch)
    with pytest.raises(SystemExit):
        cli.recipe_main(["--help"], recipe_file=str(cli.resolve_recipe_path("full_finetune")))
    assert cli.os.environ["PYTORCH_CUDA_ALLOC_CONF"] == DEFAULT_ALLOC_CONF
