"""Parity with TRL 1.16's ``GRPOTrainer`` loss (a test-only dependency): the same tiny checkpoint (written with
transformers' classes), the same prompts and completions, the same advantages and the same old and reference
log-probabilities; the loss and every weight's gradient agree within a bound derived from the arithmetic, for each
loss type, with and without the KL term, with one iteration (the ratio is 1) and two (old log-probabilities of a
policy that moved), at the token and the sequence level (GSPO), and with a masked truncated completion.

What had to be aligned, and how:
- layout: TRL left-pads the prompts and right-pads the completions, scoring the completion's columns; we put each
  prompt and its completion in one right-padded row with the labels shifted. Completion token ``j`` of row ``i``
  is our label at column ``len(prompt_i) - 1 + j``. RoPE sees other absolute positions (TRL numbers the left
  padding), the same relative ones: equal within rounding.
- the old and reference log-probabilities: handed to both sides as the same tensors (TRL's own policy
  log-probabilities moved by a fixed noise, so ratios leave the clip range and the KL is not 0).
- the normaliser of gradient accumulation: TRL divides by ``current_gradient_accumulation_steps`` (1 here).
"""

import dataclasses

import pytest
import torch
from models_testlib import TINY, build_random_hf_llama
from numerics import assert_close, llama_terms

from torchtune_ac.data import EMBEDDED_TOKENIZER_DIR
from torchtune_ac.models import LLAMA, load_hf
from torchtune_ac.training.grpo import (
    GRPOConfig,
    GRPOLossType,
    GRPOObjective,
    ImportanceSamplingLevel,
    ScaleRewards,
    group_advantages,
)
from torchtune_ac.training.objective import IGNORE_INDEX

trl = pytest.importorskip("trl")

ARGS = dataclasses.replace(TINY, vocab_size=512)  # the embedded tokenizer's vocabulary
PROMPTS = [[5, 17, 230], [5, 17, 230], [88, 9, 41, 300, 7], [88, 9, 41, 300, 7]]  # two prompts, two completions each
COMPLETIONS = [[44, 61, 2, 301, 12, 99], [400, 3, 3], [7, 8], [120, 19, 260, 3, 77, 50]]
MAX_NEW = 6
TEMPERATURE = 0.7


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    root = tmp_path_factory.mktemp("grpo_trl")
    build_random_hf_llama(ARGS, seed=1).save_pretrained(root / "policy")
    return root


def trl_inputs(truncated_row):
    """TRL's batch: left-padded prompts, right-padded completions, their masks (one row masked where asked)."""
    p_len, c_len = max(map(len, PROMPTS)), MAX_NEW
    prompt_ids = torch.tensor([[0] * (p_len - len(p)) + p for p in PROMPTS])
    prompt_mask = torch.tensor([[0] * (p_len - len(p)) + [1] * len(p) for p in PROMPTS])
    completion_ids = torch.tensor([c + [0] * (c_len - len(c)) for c in COMPLETIONS])
    completion_mask = torch.tensor([[1] * len(c) + [0] * (c_len - len(c)) for c in COMPLETIONS])
    if truncated_row is not None:  # as mask_truncated_completions does in _generate_and_score_completions
        completion_mask[truncated_row] = 0
    return {"prompt_ids": prompt_ids, "prompt_mask": prompt_mask, "completion_ids": completion_ids,
            "completion_mask": completion_mask}


def our_batch(inputs, advantages, old, ref):
    """The same rows in our layout, ``old`` / ``ref`` (TRL's ``[b, completion]``) moved to the label columns."""
    rows = [p + c for p, c in zip(PROMPTS, COMPLETIONS)]
    width = max(map(len, rows))
    tokens = torch.tensor([r + [0] * (width - len(r)) for r in rows])
    labels = torch.full_like(tokens, IGNORE_INDEX)
    moved = {"old_logps": old, "ref_logps": ref}
    out = {name: None if value is None else torch.zeros(tokens.shape) for name, value in moved.items()}
    for i, (p, c) in enumerate(zip(PROMPTS, COMPLETIONS)):
        kept = int(inputs["completion_mask"][i].sum())
        labels[i, len(p) - 1:len(p) - 1 + kept] = torch.tensor(c[:kept])
        for name, value in moved.items():
            if value is not None:
                out[name][i, len(p) - 1:len(p) - 1 + kept] = value[i, :kept]
    batch = {"tokens": tokens, "labels": labels, "advantages": advantages}
    batch.update({name: value for name, value in out.items() if value is not None})
    return batch


CASES = {  # name: (loss type, beta, iterations, importance level, epsilon_high, truncated row)
    **{f"{lt.value}_beta{b}_it{it}": (lt, b, it, "token", None, None)
       for lt in GRPOLossType for b in (0.0, 0.04) for it in (1, 2)},
    "dapo_clip_higher": (GRPOLossType.DAPO, 0.0, 2, "token", 0.28, None),
    "gspo": (GRPOLossType.GRPO, 0.04, 2, "sequence", None, None),
    "grpo_masked_truncated": (GRPOLossType.GRPO, 0.04, 2, "token", None, 3),
    "dr_grpo_masked_truncated": (GRPOLossType.DR_GRPO, 0.0, 2, "token", None, 3),
}


@pytest.mark.numerics
@pytest.mark.parametrize("case", sorted(CASES))
def test_loss_and_gradients_match_trl(checkpoint, case):
    import datasets
    from transformers import PreTrainedTokenizerFast

    datasets.disable_progress_bars()
    loss_type, beta, iterations, level, epsilon_high, truncated = CASES[case]
    args = trl.GRPOConfig(output_dir=str(checkpoint / "trl_out"), per_device_train_batch_size=4, num_generations=2,
                          max_completion_length=MAX_NEW, beta=beta, loss_type=loss_type.value,
                          num_iterations=iterations, importance_sampling_level=level, epsilon_high=epsilon_high,
                          temperature=TEMPERATURE, report_to=[], use_cpu=True, bf16=False)
    trainer = trl.GRPOTrainer(model=str(checkpoint / "policy"), reward_funcs=lambda completions, **kw: [0.0] * 4,
                              args=args, train_dataset=datasets.Dataset.from_list([{"prompt": "a"}] * 4),
                              processing_class=PreTrainedTokenizerFast.from_pretrained(EMBEDDED_TOKENIZER_DIR))
    trainer.model.train()
    trainer.current_gradient_accumulation_steps = 1
    inputs = trl_inputs(truncated)
    advantages = group_advantages(torch.tensor([1.0, 0.0, 0.3, 0.9]), 2, ScaleRewards.GROUP).advantages
    mask = inputs["completion_mask"]
    with torch.no_grad():
        own = trainer._get_per_token_logps_and_entropies(
            trainer.model, torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], 1),
            torch.cat([inputs["prompt_mask"], mask], 1), MAX_NEW)[0]
    noise = torch.Generator().manual_seed(0)
    spread = 0.8 if level == "sequence" else 0.3  # a sequence's ratio averages its tokens' noise: more, to clip
    old = (own + spread * torch.randn(own.shape, generator=noise)) * mask if iterations > 1 else None
    ref = (own + 0.3 * torch.randn(own.shape, generator=noise)) * mask if beta else None
    trl_batch = {**inputs, "advantages": advantages, "num_items_in_batch": mask.sum()}
    if old is not None:
        trl_batch["old_per_token_logps"] = old
    if ref is not None:
        trl_batch["ref_per_token_logps"] = ref
    trl_loss = trainer._compute_loss(trainer.model, trl_batch)
    trl_loss.backward()
    trl_grads = {name: p.grad for name, p in trainer.model.named_parameters()}

    config = GRPOConfig(num_generations=2, loss_type=loss_type, beta=beta, num_iterations=iterations,
                        importance_sampling_level=ImportanceSamplingLevel(level), epsilon_high=epsilon_high)
    model = load_hf(checkpoint / "policy").train()
    objective = GRPOObjective(config, n_chunks=3, temperature=TEMPERATURE, max_new_tokens=MAX_NEW)
    batch = our_batch(inputs, advantages, old, ref)
    targets = int(objective.targets(batch))
    parts = objective(model, batch)
    (parts.loss / targets).backward()

    seq = batch["tokens"].shape[1]
    largest_logp = float(own.abs().max())
    # Each log-probability is within a forward's rounding at its size; the loss moves by as much relative to its
    # per-token weights (ratio x advantage, kl's slope), which are of order one.
    forward = llama_terms(ARGS, seq, seq, backward=False)
    assert_close(float(parts.loss.detach()) / targets, float(trl_loss), terms=forward,
                 magnitude=(1 + abs(float(trl_loss))) * (1 + largest_logp), what="loss")
    backward = llama_terms(ARGS, seq, batch["tokens"].numel())
    for name, param in model.named_parameters():
        expected = trl_grads[LLAMA.hf.to_hf_name(name)]
        assert_close(param.grad, expected, terms=backward,
                     magnitude=float(expected.abs().max()) * (1 + 2 * largest_logp), what=f"grad {name}")
    # (grpo's loss is 0 in value with one iteration and no KL: each group's advantages sum to 0; not its gradient)
    assert float(model.output.weight.grad.abs().max()) > 1e-3
    if iterations > 1:  # the clip branches were taken
        assert trainer._metrics["train"]["clip_ratio/region_mean"][-1] > 0
        assert float(parts.metrics[4]) > 0
    if beta and loss_type in (GRPOLossType.BNPO, GRPOLossType.DAPO):  # averaged over tokens, as TRL logs it
        assert_close(float(parts.metrics[0]) / targets, trainer._metrics["train"]["kl"][-1], terms=seq, what="kl")

@pytest.mark.parametrize("scale", list(ScaleRewards))
def test_advantages_match_trls_formula(scale):
    """TRL's advantage lines (``_generate_and_score_completions``), restated with its ``nanstd``."""
    from trl.trainer.utils import nanstd

    rewards = torch.tensor([1.0, 0.0, 0.5, 0.5, 2.0, -1.0, 0.25, 0.0])
    ours = group_advantages(rewards, 4, scale)
    mean = rewards.view(-1, 4).mean(1).repeat_interleave(4)
    std = nanstd(rewards).expand_as(rewards) if scale is ScaleRewards.BATCH else \
        nanstd(rewards.view(-1, 4), dim=1).repeat_interleave(4)
    expected = rewards - mean if scale is ScaleRewards.NONE else (rewards - mean) / (std + 1e-4)
    torch.testing.assert_close(ours.advantages, expected, rtol=0, atol=1e-6)
    torch.testing.assert_close(ours.zero_std, torch.isclose(std, torch.zeros_like(std)))
