"""The same global batch gives the same training however it is split: over 2 processes (FSDP2 on gloo), over
accumulation micro-batches, or not at all, with plain or packed rows. The sampler fixes the global batch order,
so runs are comparable step for step (fp32, shuffle on, dropout off). Each split adds in another order (gloo's
reduce-scatter, the micro-batches' sums), so they agree within rounding, as ``numerics`` bounds it for training
runs: losses and gradient norms step by step, and the final weights within what Adam makes of rounding."""

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

STEPS = 5
# A step's global batch: 4 rows of max_seq_len tokens (64 from SHORT_RUN, 128 packed).
TERMS = llama_terms(LLAMA_TINY, 64, 4 * 64)
PACKED_TERMS = llama_terms(LLAMA_TINY, 128, 4 * 128)


# Packed rows of 128 tokens hold 1 to 3 of the embedded instruction samples (2.2 on average), plus a padding tail.
PACKED = ("dataset.packed=true", "max_seq_len=128")


def _run(output_dir: Path, *overrides: str, nproc: int, batch_size: int, accumulation: int) -> list[dict]:
    argv = tune_run_argv(output_dir, f"max_steps_per_epoch={STEPS}", f"batch_size={batch_size}",
                         f"gradient_accumulation_steps={accumulation}", *overrides, nproc=nproc)
    check_success(run_tune_subprocess(argv) if nproc > 1 else run_tune_in_process(argv))
    records = read_metrics(output_dir)
    assert [r["step"] for r in records] == list(range(1, STEPS + 1)), "rank 0 alone logs each step once"
    return records


def _assert_same_training(a: Path, records_a: list[dict], b: Path, records_b: list[dict], *,
                          terms: int = TERMS) -> None:
    for ra, rb in zip(records_a, records_b):
        assert ra["target_tokens"] == rb["target_tokens"], (ra, rb)  # the same samples made each step
    for name in ("loss", "grad_norm"):
        assert_steps_alike([r[name] for r in records_a], [r[name] for r in records_b], terms=terms, what=name)
    assert_weights_trained_alike(load_weights(final_checkpoint(a)), load_weights(final_checkpoint(b)),
                                 lrs=[r["lr"] for r in records_b], terms=terms)


@pytest.fixture(scope="module")
def one_batch_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[dict]]:
    """1 process, the whole global batch of 4 in one micro-batch."""
    output_dir = tmp_path_factory.mktemp("distributed") / "one_batch"
    return output_dir, _run(output_dir, nproc=1, batch_size=4, accumulation=1)


# (processes, batch_size, gradient_accumulation_steps): every row has a global batch of 4 samples per step.
@pytest.mark.parametrize(
    "split",
    [
        pytest.param((2, 2, 1), id="2_processes_x_2", marks=pytest.mark.distributed),
        # 2 processes x 1 row x 2 accumulation micro-batches: the packed test below.
        pytest.param((1, 2, 2), id="1_process_x_2_x_2_accumulation", marks=pytest.mark.numerics),
    ],
)
def test_split_global_batch_trains_like_one_batch(
    split: tuple[int, int, int], tmp_path: Path, one_batch_run: tuple[Path, list[dict]]
) -> None:
    nproc, batch_size, accumulation = split
    records = _run(tmp_path, nproc=nproc, batch_size=batch_size, accumulation=accumulation)
    _assert_same_training(tmp_path, records, *one_batch_run)


# Llama is covered above (the embedded model). Through tune run on 2 processes, from a tiny checkpoint transformers
# wrote, each kind of block and checkpoint layout once: Gemma 3 (the richest dense block: q/k norms, offset norms, post-
# norms, GeGLU, scaled and tied embeddings, sliding windows), Phi-3 (q/k/v and gate/up stacked in the checkpoint) and
# gpt-oss (attention and expert biases, sinks). Qwen3-MoE's EP 2 on 2 processes, from a checkpoint transformers wrote,
# trains as 1 process in test_expert_parallel_runs.py (its export and resumes too). The other dense families' blocks are
# parts of these: Mistral's is Llama's; Qwen2's is Llama's with q/k/v biases (gpt-oss's here) and tied embeddings (Gemma
# 3's here); Qwen3's adds q/k norms (Gemma 3's here); Gemma's is Gemma 3's without q/k and post-norms.
# Every family's logits, round trip and AC gradients match transformers' (tests/unit/checkpoint/test_family_parity.py);
# Qwen3 and Gemma 2 train under tensor parallelism on 2 gloo ranks against one process
# (tests/unit/training/test_tensor_parallel.py; Gemma 2's soft-caps act within each process). The mixture of experts
# runs with its experts split over the 2 processes (expert_parallel_dim=2: each token sent to its experts' process and
# back by all-to-all); plain FSDP2 of a mixture of experts, and EP x FSDP2, are in test_expert_parallel_runs.py.
MIXTURES_OF_EXPERTS = ("gpt_oss",)
TWO_PROCESS_FAMILIES = ("gemma3", "phi3", *MIXTURES_OF_EXPERTS)


@pytest.mark.distributed
@pytest.mark.parametrize("family", TWO_PROCESS_FAMILIES)
def test_every_family_trains_alike_on_2_processes_and_1(family: str, tmp_path: Path, embedded_checkpoint: Path) -> None:
    checkpoint = write_hf_checkpoint(family, tmp_path / "checkpoint", seed=5, vocab_size=512,
                                     tie_word_embeddings=family == "gemma3")
    overrides = ("model._component_=torchtune_ac.models.from_hf_config", f"checkpoint_dir={checkpoint}",
                 f"tokenizer.path={embedded_checkpoint}")
    split = ("expert_parallel_dim=2",) if family in MIXTURES_OF_EXPERTS else ()
    one = _run(tmp_path / "one", *overrides, nproc=1, batch_size=4, accumulation=1)
    two = _run(tmp_path / "two", *overrides, *split, nproc=2, batch_size=2, accumulation=1)
    with torch.device("meta"):
        args = from_hf_config(checkpoint).args
    _assert_same_training(tmp_path / "two", two, tmp_path / "one", one, terms=llama_terms(args, 64, 4 * 64))
    assert one[-1]["loss"] < one[0]["loss"]


@pytest.mark.numerics
@pytest.mark.distributed
def test_the_memory_switches_train_alike_on_2_processes_and_1(tmp_path: Path) -> None:
    switches = ("optimizer_in_bwd=true", "clip_grad_norm=null", "loss_chunks=4")
    one = _run(tmp_path / "one", *switches, nproc=1, batch_size=4, accumulation=1)
    two = _run(tmp_path / "two", *switches, nproc=2, batch_size=2, accumulation=1)
    _assert_same_training(tmp_path / "two", two, tmp_path / "one", one)


@pytest.mark.distributed
def test_packed_rows_train_alike_on_2_processes_with_accumulation(tmp_path: Path) -> None:
    """Packed attention (one causal call per document) under FSDP2, with gradient accumulation: 2 processes x 1 row
    x 2 micro-batches = 1 process x 4 rows (each micro-batch's summed loss divided by the step's target tokens over
    every micro-batch and process)."""
    one = _run(tmp_path / "one", *PACKED, nproc=1, batch_size=4, accumulation=1)
    two = _run(tmp_path / "two", *PACKED, nproc=2, batch_size=1, accumulation=2)
    assert all(record["tokens"] == 4 * 128 for record in one)  # every row packed to exactly max_seq_len
    _assert_same_training(tmp_path / "two", two, tmp_path / "one", one, terms=PACKED_TERMS)
