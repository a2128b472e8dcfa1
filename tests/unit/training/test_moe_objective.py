"""The load-balancing loss in the objective (``training/objective.py``): added as transformers adds it where the
model asks for it, reported either way, and its gradient the same under every AC mode."""

import copy
import dataclasses
import math

import pytest
import torch

from torchtune_ac.models import QWEN3_MOE, llama_tiny
from torchtune_ac.models.families.qwen3_moe import QWEN3_MOE_TINY
from torchtune_ac.models.moe import load_balancing_loss, moe_router_outputs
from torchtune_ac.activation_checkpointing import setup_activation_checkpointing
from torchtune_ac.data import collate_preference_batch
from torchtune_ac.data.preference import EncodedPair, pair_sample
from torchtune_ac.training.dpo import DPO_METRICS, DPOConfig, DPOObjective, freeze_reference
from torchtune_ac.training.objective import CrossEntropy, LoadBalancedObjective, cross_entropy_sum, with_load_balancing

TOKENS = torch.randint(0, 512, (2, 24), generator=torch.Generator().manual_seed(0))
BATCH = {"tokens": TOKENS, "labels": torch.roll(TOKENS, -1, dims=1)}


def _model(add: bool) -> torch.nn.Module:
    args = dataclasses.replace(QWEN3_MOE_TINY, moe=dataclasses.replace(QWEN3_MOE_TINY.moe, aux_loss=add,
                                                                       aux_loss_coef=0.5))
    torch.manual_seed(0)
    model = QWEN3_MOE.build(args)
    model.init_weights()
    return model


@pytest.mark.parametrize("add", [True, False])
def test_the_loss_is_the_cross_entropy_plus_the_weighted_aux_loss_per_target(add):
    model = _model(add)
    objective = with_load_balancing(CrossEntropy(), model)
    assert isinstance(objective, LoadBalancedObjective)
    # Added, the loss's two terms are logged apart too (they sum to it).
    assert objective.metric_names == (("moe_aux_loss", "ce_loss", "moe_aux_term") if add else ("moe_aux_loss",))
    parts = objective(model, BATCH)
    targets = int((BATCH["labels"] != -100).sum())
    # The same forward replayed in this process: the same values bit for bit.
    cross_entropy = cross_entropy_sum(model(TOKENS), BATCH["labels"])
    aux = load_balancing_loss([r.logits for r in moe_router_outputs(model)], 8, 2)
    assert torch.equal(parts.loss, cross_entropy + 0.5 * aux * targets if add else cross_entropy)
    assert torch.equal(parts.metrics[0], aux.detach() * targets)  # reported whether added or not
    if add:
        assert torch.equal(parts.metrics[1:3], torch.stack([cross_entropy, 0.5 * aux * targets]).detach())
        assert torch.equal(parts.metrics[1] + parts.metrics[2], parts.loss.detach())
    counts = parts.metrics[len(objective.metric_names):].view(3, 8)  # the 3 sparse layers' experts
    assert counts.sum(dim=1).tolist() == [2.0 * TOKENS.numel()] * 3


def test_a_dense_model_keeps_its_objective():
    objective = CrossEntropy()
    assert with_load_balancing(objective, llama_tiny()) is objective


@pytest.mark.parametrize("keys", [{"ac_mode": "full"}, {"ac_mode": "selective", "ac_option": "op"}])
def test_every_ac_mode_gives_the_gradients_of_no_ac(keys):
    gradients = []
    for ac in ({}, keys):
        model = _model(add=True)
        setup_activation_checkpointing(model, **ac)
        with_load_balancing(CrossEntropy(), model)(model, BATCH).loss.backward()
        gradients.append({name: p.grad for name, p in model.named_parameters()})
    for name, grad in gradients[0].items():
        # Bit for bit: one process, the same ops replayed (the router's aux-loss gradient included).
        assert torch.equal(gradients[1][name], grad), name
    assert gradients[0]["layers.1.mlp.router.weight"].abs().sum() > 0


def test_dpo_on_a_mixture_of_experts_logs_the_dpo_loss_and_the_aux_term_apart():
    """An MoE DPO run's first loss is ln 2 + coef x aux, not ln 2: its DPO loss is logged apart, ln 2 at the
    start, as is the auxiliary term, and ``loss`` stays their sum, what is optimised."""
    model = _model(add=True)
    objective = with_load_balancing(DPOObjective(DPOConfig(), reference=freeze_reference(copy.deepcopy(model))), model)
    assert objective.metric_names == (*DPO_METRICS, "moe_aux_loss", "dpo_loss", "moe_aux_term")
    pairs = [EncodedPair([1, 5, 6, 7], [8, 9, 2], [10, 2]), EncodedPair([1, 11], [12, 13, 14, 2], [15, 16, 2])]
    batch = collate_preference_batch([pair_sample(pair) for pair in pairs], pad_id=0)
    parts = objective(model, batch)
    logged = dict(zip(objective.metric_names, (parts.metrics[:len(objective.metric_names)] / 2).tolist()))
    assert logged["dpo_loss"] == pytest.approx(math.log(2), rel=1e-6)  # the policy is its reference: ln 2 a pair
    assert logged["moe_aux_term"] == pytest.approx(0.5 * logged["moe_aux_loss"], rel=1e-6)
    assert torch.equal(parts.metrics[len(DPO_METRICS) + 1] + parts.metrics[len(DPO_METRICS) + 2], parts.loss.detach())
