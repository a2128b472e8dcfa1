"""DPO with images against TRL 1.16's ``DPOTrainer`` on transformers' Qwen2_5_VLForConditionalGeneration: the same
tiny checkpoints (a policy perturbed from the embedded VLM, which is the reference), the same four pairs of the
embedded vision preference task. TRL's own vision collator (``DataCollatorForVisionPreference``) makes its batch from
the records: its tokens are ours, and the loss, the rewards and the gradient norm agree within the bounds of the
text parity test (``test_dpo_trl_parity.py``, whose alignment notes hold here too)."""

import json
from pathlib import Path

import pytest
import torch
from numerics import assert_close, llama_terms
from test_dpo_trl_parity import slopes

from torchtune_ac.data.embedded import EMBEDDED_VLM_PREFERENCE_PATH, EMBEDDED_VLM_PROCESSOR_DIR
from torchtune_ac.data.vision import load_vision_processor
from torchtune_ac.data.vision_preference import build_vision_preference_dataset, collate_vision_preference_batch
from torchtune_ac.embedded import ensure_embedded_vlm_checkpoint
from torchtune_ac.models import load_hf
from torchtune_ac.models.families.qwen2_5_vl import QWEN2_5_VL_TINY
from torchtune_ac.training.dpo import DPO_METRICS, DPOConfig, DPOObjective, answer_logps, freeze_reference

trl = pytest.importorskip("trl")
PAIRS = 4


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """(policy, reference): the embedded tiny VLM as the reference, and a copy with every weight moved by seeded noise
    (so that the rewards are not zero) as the policy, written by transformers."""
    from transformers import Qwen2_5_VLForConditionalGeneration

    reference = ensure_embedded_vlm_checkpoint(tmp_path_factory.mktemp("cache"))
    model = Qwen2_5_VLForConditionalGeneration.from_pretrained(reference)
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.add_(0.02 * torch.randn(parameter.shape, generator=generator))
    policy = tmp_path_factory.mktemp("policy")
    model.save_pretrained(policy)
    return policy, reference


def trl_examples(records):
    """The records as TRL's collator takes them: the images opened."""
    from PIL import Image

    base = Path(EMBEDDED_VLM_PREFERENCE_PATH).parent
    return [{**record, "images": [Image.open(base / name).convert("RGB") for name in record["images"]]}
            for record in records]


@pytest.mark.numerics
def test_vision_dpo_matches_trl_on_image_pairs(checkpoints, tmp_path):
    import datasets
    from transformers import Qwen2_5_VLForConditionalGeneration
    from trl.trainer.dpo_trainer import DataCollatorForVisionPreference

    policy_dir, reference_dir = checkpoints
    processor = load_vision_processor(EMBEDDED_VLM_PROCESSOR_DIR)
    lines = Path(EMBEDDED_VLM_PREFERENCE_PATH).read_text().splitlines()[:PAIRS]
    (tmp_path / "pairs.jsonl").write_text("".join(line + "\n" for line in lines))
    for name in {n for line in lines for n in json.loads(line)["images"]}:  # the images beside the file
        (tmp_path / name).parent.mkdir(exist_ok=True)
        (tmp_path / name).write_bytes((Path(EMBEDDED_VLM_PREFERENCE_PATH).parent / name).read_bytes())
    dataset = build_vision_preference_dataset(str(tmp_path / "pairs.jsonl"), processor, max_seq_len=64)
    pad_id = processor.tokenizer.pad_token_id
    batch = collate_vision_preference_batch([dataset[i] for i in range(PAIRS)], pad_id=pad_id)

    records = [json.loads(line) for line in lines]
    inputs = DataCollatorForVisionPreference(processor)(trl_examples(records))
    # The same rows (chosen, then rejected), tokens, targets and images as TRL's collator makes.
    mask = inputs["attention_mask"].bool()
    assert inputs["input_ids"].shape == batch["tokens"].shape
    assert torch.equal(inputs["input_ids"][mask], batch["tokens"][mask])
    assert torch.equal(mask, batch["tokens"] != pad_id)
    assert torch.equal(inputs["completion_mask"][:, 1:].bool(), batch["labels"][:, :-1] != -100)
    assert torch.equal(inputs["pixel_values"], batch["pixel_values"])
    assert torch.equal(inputs["image_grid_thw"], batch["image_grid_thw"])

    config = DPOConfig(beta=0.1)
    args = trl.DPOConfig(output_dir=str(tmp_path / "trl_out"), beta=config.beta, loss_type=["sigmoid"], report_to=[],
                         use_cpu=True, bf16=False)
    trainer = trl.DPOTrainer(
        model=Qwen2_5_VLForConditionalGeneration.from_pretrained(policy_dir, attn_implementation="eager"),
        ref_model=Qwen2_5_VLForConditionalGeneration.from_pretrained(reference_dir, attn_implementation="eager"),
        args=args, train_dataset=datasets.Dataset.from_list(records), processing_class=processor)
    trainer.model.train()
    trl_loss = trainer.compute_loss(trainer.model, inputs)
    trl_loss.backward()
    trl_norm = float(torch.sqrt(sum(p.grad.double().square().sum() for p in trainer.model.parameters()
                                    if p.grad is not None)))
    trl_metrics = {name: values[-1] for name, values in trainer._metrics["train"].items()}

    model = load_hf(policy_dir).train()
    reference = freeze_reference(load_hf(reference_dir))
    parts = DPOObjective(config, n_chunks=1, reference=reference)(model, batch)
    (parts.loss / PAIRS).backward()
    norm = float(torch.sqrt(sum(p.grad.double().square().sum() for p in model.parameters())))
    metrics = dict(zip(DPO_METRICS, (parts.metrics / PAIRS).tolist()))
    with torch.no_grad():
        policy, reference_logps = answer_logps(model, batch, 1), answer_logps(reference, batch, 1)

    # Bounds as the text test's, over both towers' chains of additions (the tower's are shorter than the decoder's).
    seq, tokens = batch["tokens"].shape[1], batch["tokens"].numel()
    forward = 2 * llama_terms(QWEN2_5_VL_TINY, seq, seq, backward=False)
    largest = float(torch.cat([policy, reference_logps]).abs().max())
    slope, curvature = slopes(config, policy, reference_logps, (batch["labels"] != -100).sum(dim=1))
    assert_close(float(parts.loss.detach()) / PAIRS, float(trl_loss), terms=forward, magnitude=2 * slope * largest,
                 what="loss")
    for ours, theirs in (("rewards_chosen", "rewards/chosen"), ("rewards_rejected", "rewards/rejected")):
        assert_close(metrics[ours], trl_metrics[theirs], terms=forward, magnitude=2 * config.beta * largest, what=ours)
    assert_close(norm, trl_norm, terms=2 * llama_terms(QWEN2_5_VL_TINY, seq, tokens),
                 magnitude=trl_norm * (1 + 2 * curvature * largest), what="gradient norm")
    assert trl_metrics["rewards/chosen"] != 0 and trl_metrics["rewards/rejected"] != 0  # a reference of its own
