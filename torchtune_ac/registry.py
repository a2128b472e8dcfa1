"""Built-in recipes and configs, wherever they live, and what a recipe module is.

In a source checkout they are the top-level ``recipes/`` and ``configs/`` folders; an installed wheel carries
the same files as the ``torchtune_ac._recipes`` and ``torchtune_ac._configs`` packages (see pyproject.toml).

A config belongs to the recipe its launch line names: every built-in config opens with a comment showing how
to run it (``#   tune run [launcher flags] RECIPE --config NAME``), and that line is what maps it to its
recipe, so a new config or a new recipe needs no entry here.
"""

from __future__ import annotations

import importlib.util
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional, Protocol, runtime_checkable

# "#   tune run --nproc_per_node 2 full_finetune --config tiny/full ...": the recipe is the first word after the
# launcher flags (each "--flag value").
_LAUNCH_LINE = re.compile(r"^#\s*tune run\s+(?:--\S+\s+\S+\s+)*(?P<recipe>[A-Za-z_][\w]*)\s+--config\b")


@runtime_checkable
class RecipeModule(Protocol):
    """What a recipe file defines (``tune run``, ``tune validate``).

    Attributes:
        CONFIG_SCHEMA: the typed schema of its configs (a dataclass).
    """

    CONFIG_SCHEMA: type

    def preflight(self, cfg: Any, *, strict: bool = True, world_size: Optional[int] = 1) -> list[tuple[str, str]]:
        """The run's plan and the checks' findings as summary lines (``tune validate``; with ``strict=False`` what
        is missing on this machine is a warning)."""

    def run(self, cfg: Any) -> None:
        """Run it (in each process of a multi-process run)."""


RECIPE_INTERFACE = ("CONFIG_SCHEMA", "preflight", "run")  # RecipeModule's members, for a message naming the missing


@runtime_checkable
class PlannedRecipe(RecipeModule, Protocol):
    """A recipe whose step the memory planner can simulate: ``tune plan`` answers for its configs."""

    def plan(self, cfg: Any, *, world_size: Optional[int], budget_gib: Optional[float]) -> Any:
        """The run's plan and the memory per process of every activation checkpointing setting (a
        ``run.memory_table.MemoryTable``); ``world_size`` None: no ``--nproc``, the fewest processes the config's
        parallel degrees run on; ``budget_gib`` None: the config's own budget, if any."""


@runtime_checkable
class LaunchCheckedRecipe(RecipeModule, Protocol):
    """A recipe whose launcher checks, before starting N processes, what they would report differently from one
    another (``run.preflight.check_launch``)."""

    def check_launch(self, cfg: Any, *, world_size: Optional[int], nproc_per_node: int) -> None:
        """Raise ``UserError`` (one line) for what the processes would report each on its own."""


@dataclass(frozen=True)
class Recipe:
    """A built-in recipe: its name (as given to ``tune run``)."""

    name: str

    @property
    def path(self) -> Path:
        return recipes_dir() / f"{self.name}.py"

    @property
    def configs(self) -> tuple[str, ...]:
        """The built-in configs made for it: those whose launch line names it (found on disk)."""
        root = configs_dir()
        return tuple(sorted(path.relative_to(root).with_suffix("").as_posix() for path in root.glob("*/*.yaml")
                            if config_recipe(path) == self.name))


RECIPES: tuple[Recipe, ...] = (Recipe("full_finetune"), Recipe("full_dpo"), Recipe("lora_finetune"),
                               Recipe("lora_dpo"), Recipe("grpo"), Recipe("lora_grpo"))


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


def config_recipe(path: Path) -> Optional[str]:
    """The recipe a config's launch comment names (its first ``# tune run ... RECIPE --config`` line), or None."""
    for line in path.read_text(encoding="utf-8").splitlines():
        if not line.startswith("#"):
            break
        match = _LAUNCH_LINE.match(line)
        if match:
            return match.group("recipe")
    return None


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
