"""Expert parallelism through ``tune run``: ``expert_parallel_dim: 2`` on 2 processes (gloo) trains a Qwen3-MoE
(a checkpoint transformers wrote: a dense layer, then a sparse one of 4 experts) as 1 process does, and so does
EP 2 x FSDP2 2 on 4; a run resumes across the layouts (EP 2 -> 1 process, 1 process -> EP 2, EP 2 x FSDP2 2 ->
FSDP2 over 4, the experts gathered whole again), and an EP run's Hugging Face export holds what one process's does
and loads in transformers. (Both families with EP 2 on 2 processes: ``test_distributed.py``'s every-family test.)

The global batch is the same in every layout (4 rows a step: each process reads its own share), so the runs are
comparable step for step; they add in other orders (each expert's gradient summed over the processes' tokens), so
they agree within rounding as ``numerics`` bounds training runs. A constant learning rate keeps a 3-step run and
the first 3 steps of a 6-step one alike (a resume lengthens the run with ``epochs=2``).

The one-line refusals (a degree the experts or the world cannot be split by, tensor parallelism of a mixture of
experts, a checkpoint with another number of experts) are here too.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from finetune_runs import (
    check_success,
    final_checkpoint,
    load_weights,
    run_tune_in_process,
    run_tune_subprocess,
    tune_run_argv,
)
from hf_families import write_hf_checkpoint
from numerics import assert_close, assert_steps_alike, assert_weights_trained_alike, llama_terms
from transformers import Qwen3MoeForCausalLM

from torchtune_ac.checkpoint.recipe_state import list_checkpoints
from torchtune_ac.models import from_hf_config, load_hf
from torchtune_ac.observability.metrics import read_metrics
from torchtune_ac.parallel.expert_parallel import busiest_rank_load

STEPS = 3
COMMON = ("max_seq_len=64", f"max_steps_per_epoch={STEPS}", "lr_scheduler=null",
          "model._component_=torchtune_ac.models.from_hf_config")


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_hf_checkpoint("qwen3_moe", tmp_path_factory.mktemp("moe") / "checkpoint", seed=5, vocab_size=512)


@pytest.fixture(scope="module")
def terms(checkpoint: Path) -> int:
    with torch.device("meta"):
        args = from_hf_config(checkpoint).args
    return llama_terms(args, 64, 4 * 64)


def _run(output_dir: Path, checkpoint: Path, tokenizer: Path, *overrides: str, nproc: int = 1, ep: int = 1,
         epochs: int = 1, resume: bool = False) -> list[dict]:
    """A run of ``epochs`` x 3 steps of 4 rows (each process its share), its metrics records."""
    argv = tune_run_argv(output_dir, *COMMON, f"checkpoint_dir={checkpoint}", f"tokenizer.path={tokenizer}",
                         f"batch_size={4 // nproc}", f"expert_parallel_dim={ep}", f"epochs={epochs}", *overrides,
                         *(("resume_from_checkpoint=true",) if resume else ()), nproc=nproc)
    check_success(run_tune_subprocess(argv) if nproc > 1 else run_tune_in_process(argv))
    records = read_metrics(output_dir)
    assert [r["step"] for r in records] == list(range(1, epochs * STEPS + 1)), "rank 0 alone logs each step once"
    return records


def _assert_same_training(records: list[dict], expected: list[dict], terms: int,
                          weights: tuple[Path, Path] | None = None) -> None:
    """Step for step: the same samples, losses and gradient norms within rounding; the weights of two checkpoints
    too when ``weights`` names them."""
    assert [r["target_tokens"] for r in records] == [r["target_tokens"] for r in expected[:len(records)]]
    for name in ("loss", "grad_norm"):
        assert_steps_alike([r[name] for r in records], [r[name] for r in expected[:len(records)]], terms=terms,
                           what=name)
    if weights is not None:
        ours, theirs = (load_weights(path) for path in weights)
        assert_weights_trained_alike(ours, theirs, lrs=[r["lr"] for r in records], terms=terms)


@pytest.fixture(scope="module")
def one_process(tmp_path_factory: pytest.TempPathFactory, checkpoint: Path,
                embedded_checkpoint: Path) -> tuple[Path, list[dict]]:
    """1 process, 2 epochs of 3 steps (a checkpoint after each): what every layout is compared with."""
    output_dir = tmp_path_factory.mktemp("ep") / "one"
    return output_dir, _run(output_dir, checkpoint, embedded_checkpoint, epochs=2)


@pytest.mark.slow
@pytest.mark.distributed
def test_ep_2_trains_as_one_process_exports_its_weights_and_resumes_on_one_and_back(
        tmp_path: Path, checkpoint: Path, embedded_checkpoint: Path, terms: int, one_process) -> None:
    one_dir, one = one_process
    after_3, after_6 = list_checkpoints(one_dir)
    # EP 2 on 2 processes: the first 3 steps as 1 process's. Its Hugging Face export (each process wrote its
    # experts' rows) holds one process's weights after them, in the published layout, which transformers loads.
    ep = _run(tmp_path / "ep", checkpoint, embedded_checkpoint, nproc=2, ep=2)
    exported = final_checkpoint(tmp_path / "ep")
    # Each layer's busiest process against the mean, from the experts' counts; only under expert parallelism.
    assert all(r["moe_ep_rank_load"] == busiest_rank_load(r["moe_expert_tokens"], 2) for r in ep)
    assert all(min(r["moe_ep_rank_load"]) >= 1.0 for r in ep) and "moe_ep_rank_load" not in one[0]
    _assert_same_training(ep, one, terms, weights=(exported, after_3))
    ours = load_hf(exported).eval()
    theirs = Qwen3MoeForCausalLM.from_pretrained(exported, attn_implementation="eager").eval()
    tokens = torch.randint(0, 512, (1, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert_close(ours(tokens), theirs(tokens).logits, terms=llama_terms(ours.args, 16, 0, backward=False),
                     what="logits")
    # ...resumed on 1 process for 3 more: all 6 steps as the uninterrupted run's, the final weights too.
    resumed = _run(tmp_path / "ep", checkpoint, embedded_checkpoint, epochs=2, resume=True)
    _assert_same_training(resumed, one, terms, weights=(final_checkpoint(tmp_path / "ep"),
                                                        after_6))
    # 1 process for 3 steps, resumed as EP 2.
    _run(tmp_path / "back", checkpoint, embedded_checkpoint)
    back = _run(tmp_path / "back", checkpoint, embedded_checkpoint, nproc=2, ep=2, epochs=2, resume=True)
    _assert_same_training(back, one, terms, weights=(final_checkpoint(tmp_path / "back"),
                                                     after_6))


@pytest.mark.slow
@pytest.mark.distributed
def test_ep_2_x_fsdp_2_trains_as_one_process_and_resumes_as_fsdp_4(
        tmp_path: Path, checkpoint: Path, embedded_checkpoint: Path, terms: int, one_process) -> None:
    one_dir, one = one_process
    grid = _run(tmp_path / "grid", checkpoint, embedded_checkpoint, nproc=4, ep=2)  # mesh expert_shard 2 x ep 2
    _assert_same_training(grid, one, terms)
    flat = _run(tmp_path / "grid", checkpoint, embedded_checkpoint, nproc=4, epochs=2, resume=True)  # FSDP2 over 4
    _assert_same_training(flat, one, terms, weights=(final_checkpoint(tmp_path / "grid"),
                                                     final_checkpoint(one_dir)))


@pytest.mark.parametrize("config, overrides, nproc, message", [
    ("tiny/moe", ("expert_parallel_dim=3",), 6,
     "expert_parallel_dim=3: must divide the model's 8 experts a layer (each process of a group holds as many)"),
    ("tiny/moe", ("expert_parallel_dim=4",), 6,
     "expert_parallel_dim=4: must divide the processes each replica shards over (world size 6 / "
     "fsdp.replicate_degree 1 = 6)"),
    ("tiny/moe", ("tensor_parallel_dim=2",), 2,
     "tensor_parallel_dim=2: a mixture of experts (8 experts a layer) does not run under tensor parallelism; use "
     "tensor_parallel_dim: 1, and expert_parallel_dim to split its experts"),
    ("tiny/full", ("expert_parallel_dim=2",), 2,
     "expert_parallel_dim=2: the model has no mixture-of-experts layers to split; use expert_parallel_dim: 1"),
])
def test_tune_plan_refuses_a_layout_the_experts_or_the_world_cannot_be_split_by(config, overrides, nproc,
                                                                                message) -> None:
    result = run_tune_in_process(["plan", "--config", config, "--nproc", str(nproc), *overrides])
    assert result.returncode == 2
    assert result.stderr.strip() == f"tune: error: {message}"


def test_a_checkpoint_with_another_number_of_experts_is_refused_before_anything_is_written(
        tmp_path: Path, checkpoint: Path, embedded_checkpoint: Path) -> None:
    """config.json says 8 experts a layer, its tensors hold 4: refused from the files' headers, in one line."""
    edited = tmp_path / "edited"
    shutil.copytree(checkpoint, edited)
    config = json.loads((edited / "config.json").read_text())
    config["num_local_experts"] = config["num_experts"] = 8
    (edited / "config.json").write_text(json.dumps(config))
    output_dir = tmp_path / "out"
    result = run_tune_in_process(tune_run_argv(output_dir, *COMMON, f"checkpoint_dir={edited}",
                                               f"tokenizer.path={embedded_checkpoint}"))
    assert result.returncode == 2
    (line,) = result.stderr.strip().splitlines()
    assert line.startswith(f"tune: error: {edited}: model.safetensors: model.layers.1.mlp.gate.weight has shape "
                           "[4, 32], expected [8, 32]"), line
    assert not output_dir.exists()
