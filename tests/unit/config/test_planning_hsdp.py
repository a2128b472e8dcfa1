"""``tune plan`` with HSDP: parameters, gradients and optimizer state are divided by the shard degree (``--nproc``
over ``fsdp.replicate_degree``), not the world size; a world that is not whole rows of replicas is refused; the
reduce buffer is the largest FSDP2 group's; ``tune validate`` shows the sharding as resolved."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from torchtune_ac.cli import load_recipe, load_recipe_config, main, resolve_recipe_path
from torchtune_ac.memory.planner.simulation import _largest_outer_group
from torchtune_ac.models.families.llama import LLAMA_TINY
from torchtune_ac.models.llama import Llama
from torchtune_ac.run.memory_table import memory_table


def _table(world_size: int, *overrides: str):
    recipe = load_recipe(resolve_recipe_path("full_finetune"))
    cfg = load_recipe_config(recipe, "tiny/full", ["max_seq_len=64", *overrides], [])
    return memory_table(cfg, world_size=world_size, budget_gib=None)


def _resident(table) -> list[tuple[int, int]]:
    return [(e.parameters, e.optimizer) for e in table.estimates]


def test_plan_divides_by_the_shard_degree_not_the_world_size():
    hsdp = _table(4, "fsdp.replicate_degree=2")
    two = _table(2)
    four = _table(4)
    assert _resident(hsdp) == _resident(two)  # 2 replicas of 2 shards: each process holds half the model
    assert _resident(hsdp) != _resident(four)
    assert [e.gradients for e in hsdp.estimates] == [e.gradients for e in two.estimates]
    assert all(h.parameters >= 2 * f.parameters - 8 for h, f in zip(hsdp.estimates, four.estimates))
    assert "4 process(es) (2 replicas x 2 shards, HSDP)" in hsdp.title


def test_plan_refuses_a_world_that_is_not_whole_rows(capsys):
    assert main(["plan", "--config", "tiny/full", "max_seq_len=64", "--nproc", "3", "fsdp.replicate_degree=2"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "fsdp.replicate_degree=2: the world size (3 process(es)) must be a multiple" in err[0]


@pytest.mark.parametrize("value", ["0", "-1"])
def test_replicate_degree_below_one_is_refused_naming_the_key(value, capsys):
    assert main(["validate", "--config", "tiny/full", f"fsdp.replicate_degree={value}"]) == 2
    assert f"fsdp.replicate_degree={value}: must be >= 1" in capsys.readouterr().err


def test_run_refuses_a_world_that_is_not_whole_rows_before_launching(tmp_path, capsys):
    argv = ["run", "--nproc_per_node", "3", "full_finetune", "--config", "tiny/full", "fsdp.replicate_degree=2",
            f"output_dir={tmp_path / 'out'}"]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].endswith(
        "fsdp.replicate_degree=2: the world size (3 process(es)) must be a multiple of it (each replica shards the "
        "model over world size / replicate_degree processes)")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    "overrides, expected",
    [
        (["dtype=bf16"], "gradients reduced in bf16 (dtype)"),  # the default follows the storage dtype
        (["dtype=bf16", "fsdp.reduce_dtype=fp32"], "gradients reduced in fp32"),
        (["fsdp.replicate_degree=2"], "HSDP: 2 replicas, each sharded over world size / 2; gradients reduced in fp32 (dtype)"),
    ],
)
def test_validate_shows_the_resolved_sharding(overrides, expected, capsys):
    assert main(["validate", "--config", "tiny/full", *overrides]) == 0
    line = next(line for line in capsys.readouterr().out.splitlines() if line.strip().startswith("fsdp "))
    assert line.rstrip().endswith(expected)


@pytest.mark.parametrize("tied", [False, True])
def test_the_planner_sizes_the_reduce_buffer_by_the_largest_group_outside_the_blocks(tied):
    """The embeddings and [norm, output] are reduced as groups of their own: the largest reduce-scatter outside the
    blocks is the larger of the two, not both together (a tied pair stays one group, with the root)."""
    with torch.device("meta"):
        model = Llama(dataclasses.replace(LLAMA_TINY, n_layers=1, tie_embeddings=tied))
    in_blocks = {id(p) for p in model.layers.parameters()}
    embedding = model.tok_embeddings.weight.nbytes
    norm = model.norm.weight.nbytes
    expected = embedding + norm if tied else max(embedding, norm + model.output.weight.nbytes)
    assert _largest_outer_group(model, in_blocks) == expected
