"""Tensor parallelism through ``tune run``: ``tensor_parallel_dim: 2`` on 2 processes (gloo) trains as 1 process
does, for Llama, Qwen3 and Phi-3 (Gemma 3 and 2 under TP 2: tests/unit/training/test_tensor_parallel.py); so do FSDP 2 x TP 2 and HSDP 2 x TP 2 on 4; and a run resumes across the
layouts (TP 2 -> 1 process, 1 process -> TP 2, FSDP 2 x TP 2 -> HSDP 2 x TP 2).

The global batch is the same in every layout (4 rows a step: a tensor-parallel group reads one share together),
so the runs are comparable step for step; they add in other orders (the split matrix multiplies and the loss on
vocabulary shards), so they agree within rounding as ``numerics`` bounds training runs: losses and gradient norms
step by step, the final weights within what Adam makes of rounding. A constant learning rate keeps a 3-step run
and the first 3 steps of a 6-step one alike (a resume lengthens the run with ``epochs=2``).

The one-line refusals (a degree the model or the world cannot be split by, DPO under TP) are here too.
"""

from __future__ import annotations

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
from numerics import assert_steps_alike, assert_weights_trained_alike, llama_terms

from torchtune_ac.models import from_hf_config
from torchtune_ac.models.families.llama import LLAMA_TINY
from torchtune_ac.observability.metrics import read_metrics

STEPS = 3
# 4 rows a step of at most 64 tokens; a constant rate (see the module docstring).
COMMON = ("max_seq_len=64", f"max_steps_per_epoch={STEPS}", "lr_scheduler=null")
TERMS = llama_terms(LLAMA_TINY, 64, 4 * 64)


def _run(output_dir: Path, *overrides: str, nproc: int = 1, tp: int = 1, epochs: int = 1,
         resume: bool = False) -> list[dict]:
    """A run of ``epochs`` x 3 steps of 4 rows (each process or TP group its share), its metrics records."""
    batch_size = 4 * tp // nproc
    argv = tune_run_argv(output_dir, *COMMON, f"batch_size={batch_size}", f"tensor_parallel_dim={tp}",
                         f"epochs={epochs}", *overrides, *(("resume_from_checkpoint=true",) if resume else ()),
                         nproc=nproc)
    check_success(run_tune_subprocess(argv) if nproc > 1 else run_tune_in_process(argv))
    records = read_metrics(output_dir)
    assert [r["step"] for r in records] == list(range(1, epochs * STEPS + 1)), "rank 0 alone logs each step once"
    return records


def _assert_same_training(records: list[dict], expected: list[dict], *, terms: int = TERMS,
                          weights: tuple[Path, Path] | None = None) -> None:
    """Step for step: the same samples (their target tokens, counted once however many processes of a group read
    them; the input tokens differ by each share's padding), losses and gradient norms within rounding; the final
    weights too when ``weights`` names both runs' output directories."""
    assert [r["target_tokens"] for r in records] == [r["target_tokens"] for r in expected[:len(records)]]
    for name in ("loss", "grad_norm"):
        assert_steps_alike([r[name] for r in records], [r[name] for r in expected[:len(records)]], terms=terms,
                           what=name)
    if weights is not None:
        ours, theirs = (load_weights(final_checkpoint(path)) for path in weights)
        assert_weights_trained_alike(ours, theirs, lrs=[r["lr"] for r in records], terms=terms)


@pytest.fixture(scope="module")
def one_process(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[dict]]:
    """The embedded Llama on 1 process, 2 epochs of 3 steps: what every layout is compared with."""
    output_dir = tmp_path_factory.mktemp("tp") / "one"
    return output_dir, _run(output_dir, epochs=2)


@pytest.mark.slow
@pytest.mark.distributed
def test_tp_2_trains_as_one_process_and_resumes_on_one_and_back(tmp_path: Path, one_process) -> None:
    one_dir, one = one_process
    # TP 2 on 2 processes: the first 3 steps as 1 process's (its weights after them: compared below, through
    # the resume, which starts from them).
    tp = _run(tmp_path / "tp", nproc=2, tp=2)
    _assert_same_training(tp, one)
    # ...resumed on 1 process for 3 more: all 6 steps as the uninterrupted run's, the final weights too.
    resumed = _run(tmp_path / "tp", epochs=2, resume=True)
    _assert_same_training(resumed, one, weights=(tmp_path / "tp", one_dir))
    # 1 process for 3 steps, resumed as TP 2.
    _run(tmp_path / "back", nproc=1)
    back = _run(tmp_path / "back", nproc=2, tp=2, epochs=2, resume=True)
    _assert_same_training(back, one, weights=(tmp_path / "back", one_dir))


@pytest.mark.slow
@pytest.mark.distributed
def test_fsdp_2_x_tp_2_trains_as_one_process_and_resumes_as_hsdp_2_x_tp_2(tmp_path: Path, one_process) -> None:
    """4 processes: the 3-D meshes. FSDP 2 x TP 2 for 3 steps, resumed (DCP, another mesh) as HSDP 2 x TP 2 for 3
    more: all 6 steps, and the final weights, as 1 process's. (A TP checkpoint resumed without TP: TP 2 -> 1 process
    above; FSDP 4: test_expert_parallel_runs.py's EP 2 x FSDP2 2 -> FSDP2 4.)"""
    one_dir, one = one_process
    grid = _run(tmp_path / "grid", nproc=4, tp=2)  # mesh shard 2 x tp 2
    _assert_same_training(grid, one)
    # mesh replicate 2 x shard 1 x tp 2
    hsdp = _run(tmp_path / "grid", "fsdp.replicate_degree=2", nproc=4, tp=2, epochs=2, resume=True)
    _assert_same_training(hsdp, one, weights=(tmp_path / "grid", one_dir))


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.parametrize("family", ["qwen3", "phi3"])
def test_tp_2_trains_as_one_process_for_qwen3_and_phi3(family: str, tmp_path: Path, embedded_checkpoint: Path) -> None:
    """Qwen3's q/k norms split by heads; Phi-3's stacked q/k/v and gate/up tensors read into and saved from each
    rank's heads and columns, its partial rotary embeddings and LongRoPE. (Gemma 3's four norms, GeGLU, tied
    embeddings split along the vocabulary and sliding window train under TP 2 as one process in
    tests/unit/training/test_tensor_parallel.py, and through ``tune run`` on 2 processes in test_distributed.py.)"""
    checkpoint = write_hf_checkpoint(family, tmp_path / "checkpoint", seed=5, vocab_size=512)
    overrides = ("model._component_=torchtune_ac.models.from_hf_config", f"checkpoint_dir={checkpoint}",
                 f"tokenizer.path={embedded_checkpoint}")
    one = _run(tmp_path / "one", *overrides)
    tp = _run(tmp_path / "tp", *overrides, nproc=2, tp=2)
    with torch.device("meta"):
        args = from_hf_config(checkpoint).args
    _assert_same_training(tp, one, terms=llama_terms(args, 64, 4 * 64), weights=(tmp_path / "tp", tmp_path / "one"))
    assert one[-1]["loss"] < one[0]["loss"]


@pytest.mark.parametrize("recipe, config, overrides, message", [
    ("full_finetune", "tiny/full", ("tensor_parallel_dim=2",),
     "tune: error: tensor_parallel_dim=2, fsdp.replicate_degree=1: the world size (1 process(es)) must be a multiple "
     "of their product (2): it is replicate x shard x tensor-parallel processes"),
    ("full_finetune", "tiny/full", ("tensor_parallel_dim=3",),
     "tune: error: tensor_parallel_dim=3, fsdp.replicate_degree=1: the world size (1 process(es)) must be a multiple "
     "of their product (3): it is replicate x shard x tensor-parallel processes"),
    ("full_dpo", "tiny/dpo", ("tensor_parallel_dim=2",),
     "tune: error: tensor_parallel_dim=2: the full_dpo recipe does not run under tensor parallelism (its sequence "
     "log-probabilities need whole vocabulary rows); use tensor_parallel_dim: 1 (FSDP, fsdp.replicate_degree for "
     "HSDP)"),
])
def test_a_layout_that_cannot_run_is_refused_in_one_line(recipe, config, overrides, message, tmp_path) -> None:
    argv = ["run", recipe, "--config", config, f"output_dir={tmp_path / 'out'}", *overrides]
    result = run_tune_in_process(argv)
    assert result.returncode == 2
    assert result.stderr.strip() == message
    assert not (tmp_path / "out" / "metrics.jsonl").exists()


@pytest.mark.parametrize("overrides, message", [
    (("tensor_parallel_dim=3",), "tensor_parallel_dim=3: must divide n_heads=4, n_kv_heads=2 (fewer than 3: heads "
                                 "are not copied across ranks), intermediate_dim=352"),
    (("tensor_parallel_dim=4",), "tensor_parallel_dim=4: must divide n_kv_heads=2 (fewer than 4: heads are not "
                                 "copied across ranks)"),
    (("tensor_parallel_dim=2", "max_seq_len=65"),
     "tensor_parallel_dim=2: must divide max_seq_len=65 (each process of a tensor-parallel group takes an equal "
     "piece of the sequence)"),
])
def test_tune_validate_refuses_a_degree_the_model_or_the_sequence_cannot_be_split_by(overrides, message) -> None:
    result = run_tune_in_process(["validate", "--config", "tiny/full", *overrides])
    assert result.returncode == 2
    assert result.stderr.strip() == f"tune: error: {message}"
