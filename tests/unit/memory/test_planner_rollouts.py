"""The planner's rollouts (``memory/planner/rollouts.py``): byte counts from shapes, the KV cache equal to what
generation allocates, and a GRPO workload's estimate: its rollouts, its resident reference, and a peak that is the
larger of the rollouts and the step."""

import dataclasses

import pytest
import torch
from models_testlib import TINY, build_random_llama

from torchtune_ac.generation.decode import kv_caches
from torchtune_ac.generation.kv_cache import DecodeState
from torchtune_ac.memory.planner import Workload, estimate_memory
from torchtune_ac.memory.planner.rollouts import ModelShape, RolloutStep, model_shape, rollout_memory
from torchtune_ac.models.llama import Llama

# Qwen3-0.6B's shape: 28 layers, 16 heads, 8 KV heads of 128, dim 1024, MLP 3072, vocabulary 151,936.
QWEN3_06B = ModelShape(n_layers=28, n_heads=16, n_kv_heads=8, head_dim=128, dim=1024, intermediate_dim=3072,
                       vocab_size=151_936)


@pytest.mark.parametrize("step, dtype, tp, kv_cache, logits, prefill", [
    # 16 completions of a 256-token prompt + 512 new in bf16: 28 x 2 x 16 x 8 x 768 x 128 x 2 bytes.
    (RolloutStep(rows=16, prompt_len=256, max_new_tokens=512), torch.bfloat16, 1,
     28 * 2 * 16 * 8 * 768 * 128 * 2, 16 * 151_936 * (2 + 20 + 8),
     max(3 * 16 * 256 * 3072 * 2, 16 * 16 * 256 * 768 * 2) + 16 * 256 * 768),
    # fp32, heads and MLP split over 2 tensor-parallel ranks.
    (RolloutStep(rows=8, prompt_len=32, max_new_tokens=32), torch.float32, 2,
     28 * 2 * 8 * 4 * 64 * 128 * 4, 8 * 151_936 * (4 + 20 + 8),
     max(3 * 8 * 32 * 1536 * 4, 8 * 8 * 32 * 64 * 4) + 8 * 32 * 64),
])
def test_rollout_bytes_from_shapes(step, dtype, tp, kv_cache, logits, prefill):
    memory = rollout_memory(step, QWEN3_06B, dtype, tensor_parallel=tp)
    assert (memory.kv_cache, memory.logits, memory.prefill) == (kv_cache, logits, prefill)
    assert memory.total == kv_cache + logits + prefill


def test_the_kv_cache_counted_is_what_generation_allocates():
    model = build_random_llama(dataclasses.replace(TINY, n_kv_heads=1), seed=0)
    step = RolloutStep(rows=6, prompt_len=5, max_new_tokens=7)
    state = DecodeState(torch.ones(step.rows, step.length, dtype=torch.bool), [None])
    with kv_caches(model, state):
        allocated = sum(m.kv_cache.k.nbytes + m.kv_cache.v.nbytes for m in model.modules() if hasattr(m, "kv_cache")
                        and m.kv_cache is not None)
    assert rollout_memory(step, model_shape(model), torch.float32).kv_cache == allocated


def adamw(params):
    return torch.optim.AdamW(params, lr=1e-5)


@pytest.mark.parametrize("reference", [False, True])
def test_a_grpo_workload_counts_its_rollouts_and_reference(reference):
    build = lambda: Llama(TINY)  # noqa: E731
    step = RolloutStep(rows=8, prompt_len=48, max_new_tokens=80, reference=reference)
    plain = Workload(batch_size=8, seq_len=128)
    before, = estimate_memory(build, adamw, plain, plans=None)[:1]
    after, = estimate_memory(build, adamw, dataclasses.replace(plain, rollouts=step), plans=None)[:1]
    rollouts = rollout_memory(step, model_shape(Llama(TINY)), torch.float32).total
    assert after.rollouts == rollouts > 0
    assert after.reference == (after.parameters if reference else 0)
    assert after.total == after.parameters + after.optimizer + after.reference + max(before.step_peak, rollouts)
    assert after.step_peak == before.step_peak  # the loss pass is the simulated step, unchanged


@pytest.mark.parametrize("overrides, schema, expected", [
    ([], "FullGRPOConfig", RolloutStep(rows=64, prompt_len=12, max_new_tokens=4, reference=False)),
    (["grpo.beta=0.04", "generation.max_new_tokens=6"], "FullGRPOConfig",
     RolloutStep(rows=64, prompt_len=10, max_new_tokens=6, reference=True)),
    (["grpo.beta=0.04"], "LoRAGRPOConfig", RolloutStep(rows=64, prompt_len=12, max_new_tokens=4, reference=False)),
])
def test_a_grpo_config_gives_the_planner_its_rollouts(overrides, schema, expected):
    from torchtune_ac.config import load_config, schema as schemas
    from torchtune_ac.config.validation import validate_config

    cfg = validate_config(load_config("tiny/grpo", overrides), getattr(schemas, schema), source="tiny/grpo")
    assert cfg.rollout_step() == expected
    assert schemas.FullFinetuneConfig.rollout_step(cfg) is None  # fine-tuning has none


def test_tune_plan_shows_the_rollouts_of_a_grpo_config(capsys):
    from torchtune_ac.cli import main
    from torchtune_ac.models import llama_tiny

    assert main(["plan", "--config", "tiny/grpo"]) == 0
    lines = capsys.readouterr().out.splitlines()
    header = next(line for line in lines if line.startswith("setting "))
    assert header.split()[3] == "rollouts"
    full = next(line for line in lines if line.startswith("full "))
    # tiny/grpo: 64 completions, prompts of up to 12 tokens and 4 new ones, fp32; 2 decimals in the table's unit
    # (MiB, or GiB where the process's measured resident set, a pytest worker's after other tests, passes 1 GiB).
    unit = next(line for line in lines if line.startswith("estimated ")).split()[1]
    with torch.device("meta"):
        shape = model_shape(llama_tiny())
    expected = rollout_memory(RolloutStep(rows=64, prompt_len=12, max_new_tokens=4), shape, torch.float32)
    assert full.split()[3] == f"{expected.total / {'MiB': 2**20, 'GiB': 2**30}[unit]:.2f}"


def test_the_plan_chart_shows_the_rollouts_at_the_peak_or_marks_them_below_it(tmp_path, monkeypatch):
    """Each bar is as tall as the device total: where the generation is the peak its rollouts stand in for the
    step's own parts; where it is not, a dotted mark shows the height they reach."""
    pytest.importorskip("matplotlib")
    from matplotlib.axes import Axes

    from torchtune_ac.activation_checkpointing.config import resolve_ac_plan
    from torchtune_ac.memory.planner.workload import MemoryEstimate
    from torchtune_ac.run.memory_table import MemoryTable, draw_memory_table

    MiB = 2**20
    plans = [resolve_ac_plan(enable_activation_checkpointing=None, ac_mode=mode, ac_option=None, n_layers=2)
             for mode in ("none", "full")]
    estimates = [MemoryEstimate(plan, parameters=6 * MiB, optimizer=12 * MiB, gradients=1 * MiB,
                                activations=activations * MiB, transient=4 * MiB, saved_activations=0, extra_flops=0.0,
                                peak_phase="backward", flops=0.0, fixed=400 * MiB, reference=6 * MiB,
                                rollouts=30 * MiB) for plan, activations in zip(plans, (80, 2))]
    bars, marks = {}, []
    real_bar, real_hlines = Axes.bar, Axes.hlines
    monkeypatch.setattr(Axes, "bar", lambda ax, x, heights, *a, label=None, **k:
                        bars.setdefault(label, list(heights)) and real_bar(ax, x, heights, *a, label=label, **k))
    monkeypatch.setattr(Axes, "hlines", lambda ax, y, *a, **k: marks.append(y) or real_hlines(ax, y, *a, **k))
    draw_memory_table(MemoryTable("t", estimates, None, None), tmp_path / "plan.png")
    assert [sum(column) for column in zip(*bars.values())] == [e.device / MiB for e in estimates]
    # none: the step (85 MiB) is the peak, the rollouts a mark at 6 + 6 + 12 + 30; full: the rollouts are the peak.
    assert bars["rollouts (generation)"] == [0, 30] and bars["activations"] == [80, 0] and marks == [54]
