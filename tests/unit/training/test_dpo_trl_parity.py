"""Parity with TRL's ``DPOTrainer`` (a test-only dependency, pinned in constraints.txt): the same tiny checkpoints
(written with transformers' classes), the same batch; the loss, the chosen and rejected rewards and the gradient
norm after one backward agree within a bound derived from the arithmetic.

What had to be aligned, and how:
- the label shift: our labels are shifted when the batch is built (``labels[:, t]`` is ``tokens[:, t + 1]`` or
  ignored); TRL shifts inside its loss, from a ``completion_mask`` over the tokens. The batch TRL gets has
  ``completion_mask[:, t + 1] = labels[:, t] != -100``.
- padding: both right-pad the 2b rows (chosen, then rejected) to one length; TRL passes an attention mask, we need
  none (causal attention: padding after a row's end cannot change what comes before).
- averaging: both take the mean over the batch's pairs; our objective returns the sum, divided here as the step
  divides it by the global pair count.
- dropout: TRL turns it off in both models (``disable_dropout``); the tiny models have none.
- conservative DPO: TRL 1.16's ``sigmoid`` loss has no label smoothing; its ``aot`` loss is the conservative form
  after sorting the batch's log-ratios, which for one pair is no sort at all, so label smoothing is compared on a
  batch of one pair.

LoRA DPO (``lora_dpo``) is compared the same way against TRL with a PEFT model (its last test).
"""

import dataclasses
import json

import pytest
import torch
from models_testlib import TINY, build_random_hf_llama
from numerics import assert_close, llama_terms

from torchtune_ac.data import EMBEDDED_TOKENIZER_DIR, collate_preference_batch, load_tokenizer, preference_dataset
from torchtune_ac.lora.config import AdapterConfig
from torchtune_ac.lora.mechanism import adapted_linears, adapters_off, apply_adapters, initialize_adapters_
from torchtune_ac.lora.peft_names import peft_tensors
from torchtune_ac.lora.reference import BaseAsReference
from torchtune_ac.models import load_hf
from torchtune_ac.training.dpo import (
    DPO_METRICS,
    DPOConfig,
    DPOLossType,
    DPOObjective,
    answer_logps,
    dpo_loss,
    freeze_reference,
)

trl = pytest.importorskip("trl")

ARGS = dataclasses.replace(TINY, vocab_size=512)  # the embedded tokenizer's vocabulary


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """Two random checkpoints (policy and reference) written by transformers, and four pairs."""
    import datasets

    datasets.disable_progress_bars()
    root = tmp_path_factory.mktemp("trl")
    for name, seed in (("policy", 1), ("reference", 2)):
        build_random_hf_llama(ARGS, seed=seed).save_pretrained(root / name)
    records = [{"prompt": f"What is {i} + {i}?", "chosen": str(2 * i), "rejected": f"{2 * i + 1}, or {i}"}
               for i in range(4)]
    (root / "pairs.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    tokenizer = load_tokenizer(EMBEDDED_TOKENIZER_DIR)
    return root, records, preference_dataset(tokenizer, source=str(root / "pairs.jsonl")), tokenizer


def run_trl(root, records, batch, pad_id, *, beta, loss_type, label_smoothing):
    """TRL's loss, metrics and gradient norm for ``batch`` (one ``compute_loss`` and its backward)."""
    import datasets
    from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast

    args = trl.DPOConfig(output_dir=str(root / "trl_out"), beta=beta, loss_type=[loss_type],
                         label_smoothing=label_smoothing, report_to=[], use_cpu=True, bf16=False)
    trainer = trl.DPOTrainer(
        model=AutoModelForCausalLM.from_pretrained(root / "policy", attn_implementation="eager"),
        ref_model=AutoModelForCausalLM.from_pretrained(root / "reference", attn_implementation="eager"),
        args=args, train_dataset=datasets.Dataset.from_list(records),
        processing_class=PreTrainedTokenizerFast.from_pretrained(EMBEDDED_TOKENIZER_DIR))
    completion = torch.zeros_like(batch["tokens"])
    completion[:, 1:] = batch["labels"][:, :-1] != -100  # TRL shifts inside: the token after each labelled position
    inputs = {"input_ids": batch["tokens"], "attention_mask": (batch["tokens"] != pad_id).long(),
              "completion_mask": completion}
    trainer.model.train()
    loss = trainer.compute_loss(trainer.model, inputs)
    loss.backward()
    norm = torch.sqrt(sum(p.grad.double().square().sum() for p in trainer.model.parameters() if p.grad is not None))
    metrics = {name: values[-1] for name, values in trainer._metrics["train"].items()}
    return float(loss), metrics, float(norm)


def run_ours(root, batch, config, n_chunks):
    """Our objective on the same checkpoints: the mean loss, the mean metrics, the gradient norm, and the
    log-probabilities (policy, reference) the bounds are derived from."""
    model = load_hf(root / "policy").train()
    reference = freeze_reference(load_hf(root / "reference"))
    objective = DPOObjective(config, n_chunks=n_chunks, reference=reference)
    parts = objective(model, batch)
    pairs = batch["tokens"].shape[0] // 2
    (parts.loss / pairs).backward()
    norm = torch.sqrt(sum(p.grad.double().square().sum() for p in model.parameters()))
    metrics = dict(zip(DPO_METRICS, (parts.metrics / pairs).tolist()))
    with torch.no_grad():
        logps = answer_logps(model, batch, n_chunks), answer_logps(reference, batch, n_chunks)
    return float(parts.loss.detach()) / pairs, metrics, float(norm), logps


def slopes(config, policy, reference, answer_tokens):
    """The mean loss's largest first derivative with respect to one log-probability, and its largest second
    derivative relative to the first (how much the gradient's weight per pair moves), in float64."""
    policy = policy.double().requires_grad_()
    loss = dpo_loss(policy, reference.double(), config, answer_tokens=answer_tokens).losses.double().mean()
    (first,) = torch.autograd.grad(loss, policy, create_graph=True)
    second = torch.stack([torch.autograd.grad(g, policy, retain_graph=True)[0].abs().max() for g in first])
    return float(first.abs().max()), float(second.max() / first.abs().max())


CASES = {
    "sigmoid": (DPOConfig(beta=0.1), "sigmoid", 1, 4),
    "sigmoid_chunked": (DPOConfig(beta=0.5), "sigmoid", 3, 4),
    "ipo": (DPOConfig(beta=0.5, loss_type=DPOLossType.IPO), "ipo", 1, 4),
    # TRL keeps conservative DPO only in its aot loss, which sorts the batch: one pair, no sort.
    "conservative": (DPOConfig(beta=0.2, label_smoothing=0.1), "aot", 1, 1),
}


@pytest.mark.numerics
@pytest.mark.parametrize("case", sorted(CASES))
def test_loss_rewards_and_gradient_norm_match_trl(setup, case):
    root, records, dataset, tokenizer = setup
    config, trl_loss_type, n_chunks, pairs = CASES[case]
    batch = collate_preference_batch([dataset[i] for i in range(pairs)], pad_id=tokenizer.pad_id)
    trl_loss, trl_metrics, trl_norm = run_trl(root, records[:pairs], batch, tokenizer.pad_id, beta=config.beta,
                                              loss_type=trl_loss_type, label_smoothing=config.label_smoothing)
    loss, metrics, norm, (policy, reference) = run_ours(root, batch, config, n_chunks)

    # Each summed log-probability: transformers and we add in other orders (attention, RoPE, norms), so each is
    # within the rounding of a forward's chain of additions, at its own size.
    seq, tokens = batch["tokens"].shape[1], batch["tokens"].numel()
    forward = llama_terms(ARGS, seq, seq, backward=False)
    largest = float(torch.cat([policy, reference]).abs().max())
    slope, curvature = slopes(config, policy, reference, (batch["labels"] != -100).sum(dim=1))
    # The loss moves by its slope times each log-probability's error; the four of a pair add as a random walk (x2).
    assert_close(loss, trl_loss, terms=forward, magnitude=2 * slope * largest, what="loss")
    # A reward is beta times a difference of two log-probabilities (x sqrt 2 < 2).
    for ours, theirs in (("rewards_chosen", "rewards/chosen"), ("rewards_rejected", "rewards/rejected"),
                         ("logps_chosen", "logps/chosen"), ("logps_rejected", "logps/rejected")):
        scale = 1.0 if ours.startswith("logps") else config.beta
        assert_close(metrics[ours], trl_metrics[theirs], terms=forward, magnitude=2 * scale * largest, what=ours)
    # The gradient: a backward's rounding of its own size, plus each pair's weight (the loss's slope) moved by the
    # log-probabilities' error, relative to it: curvature x error.
    assert_close(norm, trl_norm, terms=llama_terms(ARGS, seq, tokens),
                 magnitude=trl_norm * (1 + 2 * curvature * largest), what="gradient norm")
    assert trl_metrics["rewards/chosen"] != 0 and trl_metrics["rewards/rejected"] != 0  # a reference of its own

# ----------------------------------------------------------------------------------------------- LoRA DPO
# TRL's DPOTrainer with a PEFT model and no reference model: its reference is the PEFT model with its adapters
# disabled, as lora_dpo's is the policy with its adapters off (torchtune_ac/lora/reference.py).

LORA_TARGETS = ["q_proj", "v_proj", "down_proj"]


def adapted_policy(root):
    """Our policy with adapters whose B is not zero (so policy and reference differ)."""
    model = load_hf(root / "policy")
    apply_adapters(model, AdapterConfig(rank=4, alpha=8.0, targets=LORA_TARGETS))
    initialize_adapters_(model, seed=0)
    generator = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for _, linear in adapted_linears(model):
            linear.lora_b.weight.copy_(0.2 * torch.randn(linear.lora_b.weight.shape, generator=generator))
    return model.train()


@pytest.mark.numerics
def test_lora_dpo_matches_trl_with_a_peft_model(setup):
    import datasets
    from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast

    peft = pytest.importorskip("peft")

    root, records, dataset, tokenizer = setup
    config = DPOConfig(beta=0.1)
    batch = collate_preference_batch([dataset[i] for i in range(4)], pad_id=tokenizer.pad_id)
    ours = adapted_policy(root)

    # TRL's LoRA path: it wraps the model with peft_config, and its reference is that model with adapters disabled
    # (a PeftModel passed in would instead get a frozen copy of its adapter as reference). Our values, then.
    args = trl.DPOConfig(output_dir=str(root / "trl_lora_out"), beta=config.beta, loss_type=["sigmoid"],
                         report_to=[], use_cpu=True, bf16=False)
    trainer = trl.DPOTrainer(model=AutoModelForCausalLM.from_pretrained(root / "policy", attn_implementation="eager"),
                             peft_config=peft.LoraConfig(r=4, lora_alpha=8, target_modules=LORA_TARGETS), args=args,
                             train_dataset=datasets.Dataset.from_list(records),
                             processing_class=PreTrainedTokenizerFast.from_pretrained(EMBEDDED_TOKENIZER_DIR))
    loaded = peft.set_peft_model_state_dict(trainer.model, {k: v.detach().clone() for k, v in peft_tensors(ours).items()})
    assert not loaded.unexpected_keys
    completion = torch.zeros_like(batch["tokens"])
    completion[:, 1:] = batch["labels"][:, :-1] != -100
    inputs = {"input_ids": batch["tokens"], "attention_mask": (batch["tokens"] != tokenizer.pad_id).long(),
              "completion_mask": completion}
    trainer.model.train()
    trl_loss = trainer.compute_loss(trainer.model, inputs)
    trl_loss.backward()
    trl_norm = float(torch.sqrt(sum(p.grad.double().square().sum() for p in trainer.model.parameters()
                                    if p.grad is not None)))
    trl_metrics = {name: values[-1] for name, values in trainer._metrics["train"].items()}

    objective = BaseAsReference(DPOObjective(config, n_chunks=1, reference=None))
    parts = objective(ours, batch)
    pairs = batch["tokens"].shape[0] // 2
    (parts.loss / pairs).backward()
    norm = float(torch.sqrt(sum(p.grad.double().square().sum() for p in ours.parameters() if p.grad is not None)))
    assert all(p.grad is None for n, p in ours.named_parameters() if ".lora_" not in n)
    metrics = dict(zip(DPO_METRICS, (parts.metrics / pairs).tolist()))
    with torch.no_grad():
        policy = answer_logps(ours, batch, 1)
        with adapters_off(ours):
            reference = answer_logps(ours, batch, 1)
    assert not torch.equal(policy, reference)  # the adapters move the policy off its reference

    seq, tokens = batch["tokens"].shape[1], batch["tokens"].numel()
    forward = llama_terms(ARGS, seq, seq, backward=False)
    largest = float(torch.cat([policy, reference]).abs().max())
    slope, curvature = slopes(config, policy, reference, (batch["labels"] != -100).sum(dim=1))
    assert_close(float(parts.loss.detach()) / pairs, float(trl_loss), terms=forward, magnitude=2 * slope * largest,
                 what="loss")
    for ours_name, theirs in (("rewards_chosen", "rewards/chosen"), ("rewards_rejected", "rewards/rejected")):
        assert_close(metrics[ours_name], trl_metrics[theirs], terms=forward, magnitude=2 * config.beta * largest,
                     what=ours_name)
    assert_close(norm, trl_norm, terms=llama_terms(ARGS, seq, tokens),
                 magnitude=trl_norm * (1 + 2 * curvature * largest), what="adapters' gradient norm")
    assert trl_metrics["rewards/chosen"] != 0
