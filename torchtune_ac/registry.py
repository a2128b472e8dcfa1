"""Built-in recipes and configs, wherever they live.

In a source checkout they are the top-level ``recipes/`` and ``configs/`` folders; an installed wheel carries
the same files as the ``torchtune_ac._recipes`` and ``torchtune_ac._configs`` packages (see pyproject.toml).
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from pathlib import Path
from typing import Optional


@dataclass(frozen=True)
class Recipe:
    """A built-in recipe: its name (as given to ``tune run``)."""

    name: str

    @property
    def path(self) -> Path:
        return recipes_dir() / f"{self.name}.py"

    @property
    def configs(self) -> tuple[str, ...]:
        """The built-in configs made for it: every ``configs/<family>/<name>.yaml`` (the only recipe so far),
        found on disk, so a new config needs no entry here."""
        root = configs_dir()
        return tuple(sorted(path.relative_to(root).with_suffix("").as_posix() for path in root.glob("*/*.yaml")))


RECIPES: tuple[Recipe, ...] = (Recipe("full_finetune"),)


def _shipped_dir(package: str, source_folder: str) -> Path:
    # A source checkout uses its own folders: an editable install of another checkout (a second git worktree)
    # maps the package to that checkout's folders, and would pair this code with its recipe and configs.
    checkout = Path(__file__).resolve().parent.parent
    if (checkout / "pyproject.toml").is_file() and (checkout / source_folder).is_dir():
        return checkout / source_folder
    spec = importlib.util.find_spec(package)
    if spec is not None and spec.submodule_search_locations:
        return Path(next(iter(spec.submodule_search_locations)))
    return Path(__file__).resolve().parent.parent / source_folder


def recipes_dir() -> Path:
    """Folder holding the built-in recipe files."""
    return _shipped_dir("torchtune_ac._recipes", "recipes")


def configs_dir() -> Path:
    """Folder holding the built-in YAML configs (``<family>/<name>.yaml``)."""
    return _shipped_dir("torchtune_ac._configs", "configs")


def find_recipe(name: str) -> Optional[Recipe]:
    """The built-in recipe called ``name``, or None."""
    return next((recipe for recipe in RECIPES if recipe.name == name), None)


def builtin_config_names() -> list[str]:
    """Every built-in config name, in registry order."""
    return [name for recipe in RECIPES for name in recipe.configs]


def builtin_config_path(name: str) -> Optional[Path]:
    """The YAML file of built-in config ``name`` (``llama3/8B_full``; a trailing ``.yaml`` is tolerated)."""
    stem = name[: -len(".yaml")] if name.endswith(".yaml") else name
    if stem not in builtin_config_names():
        return None
    return configs_dir() / f"{stem}.yaml"
