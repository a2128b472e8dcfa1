"""Configs belong to the recipe their launch line names; tune plan needs a recipe that declares a workload."""

from pathlib import Path

import pytest

from torchtune_ac.registry import RECIPES, PlannedRecipe, RecipeModule, builtin_config_names, config_recipe


@pytest.mark.parametrize("header, recipe", [
    ("#   tune run full_finetune --config tiny/full\n", "full_finetune"),
    ("# comment\n#   tune run --nproc_per_node 2 --nnodes 1 distill --config x/y\n", "distill"),
    ("#   tune validate --config x/y\n", None),
    ("output_dir: o\n#   tune run full_finetune --config x/y\n", None),  # only the opening comment counts
])
def test_the_launch_line_names_the_recipe(tmp_path: Path, header, recipe):
    path = tmp_path / "c.yaml"
    path.write_text(header + "output_dir: o\n")
    assert config_recipe(path) == recipe


def test_every_built_in_config_belongs_to_a_recipe():
    assert sorted(builtin_config_names()) == sorted(
        p.relative_to(p.parents[1]).with_suffix("").as_posix()
        for p in (Path(__file__).resolve().parents[2] / "configs").glob("*/*.yaml"))
    assert [r.name for r in RECIPES] == ["full_finetune", "full_dpo", "lora_finetune", "lora_dpo", "grpo", "lora_grpo"]


def test_a_recipe_module_is_planned_only_when_it_declares_plan():
    class Plain:
        CONFIG_SCHEMA = dict

        def preflight(self, cfg, *, strict=True, world_size=1):
            return []

        def run(self, cfg):
            return None

    class Planned(Plain):
        def plan(self, cfg, *, world_size, budget_gib):
            return None

    assert isinstance(Plain(), RecipeModule) and not isinstance(Plain(), PlannedRecipe)
    assert isinstance(Planned(), PlannedRecipe)
