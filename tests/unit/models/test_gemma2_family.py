"""The Gemma 2 family: builders (published shapes, exact parameter counts), config.json translation (transformers 4
and 5 forms), the soft-caps (attention and logits) on every path that computes them: the explicit-scores kernel,
FlexAttention's (forward, on the CPU), packed rows, and the chunked losses. Logits, round trip and AC against
transformers' Gemma2ForCausalLM are in ``tests/unit/checkpoint/test_family_parity.py``."""

import dataclasses
import inspect
import json
import warnings

import pytest
import torch
from hf_families import GEMMA2_TINY, TINY_SHAPE, random_hf_model
from numerics import assert_close, llama_terms
from torch.nn.attention.flex_attention import flex_attention
from transformers import AutoConfig, Gemma2Config

import torchtune_ac.models.families.gemma2 as gemma2
from torchtune_ac.cli import main
from torchtune_ac.errors import UserError
from torchtune_ac.memory.chunked_loss import ChunkedCrossEntropy
from torchtune_ac.models import GEMMA2, family_for_hf_config, family_of, load_hf
from torchtune_ac.models.attention import (
    _per_document_attention,
    _explicit_attention,
    document_runs,
    flex_explicit_attention,
)
from torchtune_ac.models.families.gemma3 import Gemma3Block
from torchtune_ac.training.objective import IGNORE_INDEX, cross_entropy_sum
from torchtune_ac.training.sequence_logps import ChunkedSequenceLogProbs, sequence_logps

PARAMETER_COUNTS = {"gemma2_2b": 2_614_341_888, "gemma2_9b": 9_241_705_984, "gemma2_27b": 27_227_128_320}
# The config.json files published with the models (transformers 4.42: no layer_types, no tie_word_embeddings).
_COMMON = {"architectures": ["Gemma2ForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
           "attn_logit_softcapping": 50.0, "final_logit_softcapping": 30.0, "hidden_act": "gelu_pytorch_tanh",
           "hidden_activation": "gelu_pytorch_tanh", "max_position_embeddings": 8192, "model_type": "gemma2",
           "rms_norm_eps": 1e-06, "rope_theta": 10000.0, "sliding_window": 4096, "sliding_window_size": 4096,
           "cache_implementation": "hybrid", "vocab_size": 256000}
PUBLISHED = {
    "gemma2_2b": {**_COMMON, "head_dim": 256, "hidden_size": 2304, "intermediate_size": 9216,
                  "num_attention_heads": 8, "num_hidden_layers": 26, "num_key_value_heads": 4,
                  "query_pre_attn_scalar": 256},
    "gemma2_9b": {**_COMMON, "head_dim": 256, "hidden_size": 3584, "intermediate_size": 14336,
                  "num_attention_heads": 16, "num_hidden_layers": 42, "num_key_value_heads": 8,
                  "query_pre_attn_scalar": 256},
    "gemma2_27b": {**_COMMON, "head_dim": 128, "hidden_size": 4608, "intermediate_size": 36864,
                   "num_attention_heads": 32, "num_hidden_layers": 46, "num_key_value_heads": 16,
                   "query_pre_attn_scalar": 144},
}
TOKENS = torch.randint(0, 96, (2, 20), generator=torch.Generator().manual_seed(0))  # longer than the 6-token window


@pytest.mark.parametrize("name", sorted(PARAMETER_COUNTS))
def test_parameter_count_on_meta_and_the_builder_signature(name):
    assert list(inspect.signature(getattr(gemma2, name)).parameters) == ["attn_dropout", "resid_dropout", "max_seq_len"]
    with torch.device("meta"):
        model = getattr(gemma2, name)(max_seq_len=4096)
    assert family_of(model) is GEMMA2
    assert sum(p.numel() for p in model.parameters()) == PARAMETER_COUNTS[name]
    assert isinstance(model.layers[0], Gemma3Block)
    assert model.args == dataclasses.replace(getattr(gemma2, name.upper()), max_seq_len=4096)


def test_published_layers_alternate_sliding_then_global_with_the_published_caps():
    args = gemma2.GEMMA2_9B
    assert [args.window_of(i) for i in range(4)] == [4096, None, 4096, None]
    assert (args.attn_logit_softcapping, args.final_logit_softcapping) == (50.0, 30.0)
    assert (gemma2.GEMMA2_27B.resolved_head_dim, gemma2.GEMMA2_27B.query_pre_attn_scalar) == (128, 144)


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_published_config_json_translates_to_builder_args_in_both_transformers_forms(name):
    assert family_for_hf_config(PUBLISHED[name]) is GEMMA2
    assert GEMMA2.hf.args_from_hf_config(PUBLISHED[name]) == getattr(gemma2, name.upper())
    # transformers 5 writes layer_types, rope_parameters and every default.
    written = Gemma2Config(**PUBLISHED[name]).to_dict()
    assert "layer_types" in written and "rope_parameters" in written
    assert GEMMA2.hf.args_from_hf_config(written) == getattr(gemma2, name.upper())


def test_a_null_cap_is_no_cap_and_transformers_reads_our_config_alike(tmp_path):
    args = GEMMA2.hf.args_from_hf_config({**PUBLISHED["gemma2_2b"], "attn_logit_softcapping": None})
    assert (args.attn_logit_softcapping, args.final_logit_softcapping) == (None, 30.0)
    (tmp_path / "config.json").write_text(json.dumps(GEMMA2.hf.hf_config_from_args(gemma2.GEMMA2_27B, torch.bfloat16)))
    hf = AutoConfig.from_pretrained(tmp_path)
    assert type(hf).__name__ == "Gemma2Config"
    assert hf.layer_types == list(gemma2.GEMMA2_27B.layer_types)
    assert (hf.attn_logit_softcapping, hf.final_logit_softcapping, hf.query_pre_attn_scalar) == (50.0, 30.0, 144)
    assert (hf.sliding_window, hf.head_dim, hf.tie_word_embeddings) == (4096, 128, True)


@pytest.mark.parametrize("change, message", [
    ({"use_bidirectional_attention": True}, "use_bidirectional_attention=True: bidirectional attention"),
    ({"rope_scaling": {"rope_type": "linear", "factor": 2.0}}, "rope_scaling.rope_type='linear'"),
    ({"final_logit_softcapping": "30"}, "final_logit_softcapping='30': must be float"),
    ({"attn_logit_softcapping": -1.0}, "attn_logit_softcapping=-1.0 must be positive"),
])
def test_unsupported_or_invalid_configs_name_the_key(change, message):
    with pytest.raises(UserError, match="gemma2 config") as info:
        GEMMA2.hf.args_from_hf_config({**PUBLISHED["gemma2_2b"], **change})
    assert message in str(info.value)


# ---- the caps: each changes the logits, on whole rows and packed ones -----------------------------------------


@pytest.fixture(scope="module")
def reference_and_model(tmp_path_factory):
    path = tmp_path_factory.mktemp("gemma2")
    reference = random_hf_model("gemma2", seed=1)
    reference.save_pretrained(path)
    return reference, load_hf(path).eval()


def test_each_cap_and_the_window_change_the_logits(reference_and_model):
    """The parity tests can fail: the same weights without a cap, or without the window, differ from transformers."""
    reference, model = reference_and_model
    with torch.no_grad():
        expected = reference(TOKENS).logits
        assert float(expected.abs().max()) < GEMMA2_TINY["final_logit_softcapping"]
        for change in ({"attn_logit_softcapping": None}, {"final_logit_softcapping": None},
                       {"sliding_window": None, "layer_types": None}):
            changed = GEMMA2.build(dataclasses.replace(model.args, **change)).eval()
            changed.load_state_dict(model.state_dict())
            assert (changed(TOKENS) - expected).abs().max() > 1e-2, change


def test_packed_rows_give_each_document_its_own_logits(reference_and_model):
    """Soft-capped attention one document at a time: a packed row equals its documents run alone (a document
    longer than the window among them)."""
    _, model = reference_and_model
    lengths = [4, 11, 5]
    ids = torch.repeat_interleave(torch.arange(3), torch.tensor(lengths))[None]  # [1, 20]
    with torch.no_grad():
        packed = model(TOKENS[:1], document_ids=ids)
        alone = torch.cat([model(doc) for doc in TOKENS[:1].split(lengths, dim=1)], dim=1)
    assert_close(packed, alone, terms=llama_terms(model.args, 11, 0, backward=False), what="packed logits")


@pytest.mark.parametrize("packed", [False, True], ids=["rows", "packed"])
@pytest.mark.parametrize("window", [None, 5])
def test_flex_attention_computes_the_explicit_kernels_attention(packed, window):
    """The CUDA path (FlexAttention: the cap as score_mod, causal, window and documents as its block mask) against
    the explicit-scores path, forward, run uncompiled on the CPU (where FlexAttention has no backward)."""
    generator = torch.Generator().manual_seed(3)
    b, s, hd = 2, 24, 16
    q = torch.randn(b, 4, s, hd, generator=generator) * 2  # scores of several units: the cap of 2 bends them
    k, v = (torch.randn(b, 2, s, hd, generator=generator) * 2 for _ in range(2))
    runs = document_runs(torch.tensor([[0] * 7 + [1] * 17, [0] * 20 + [1] * 4])) if packed else None
    options = dict(gqa=True, scale=0.3, window=window, softcap=2.0)
    expected = (_per_document_attention(q, k, v, runs=runs, dropout_p=0.0, **options) if packed
                else _explicit_attention(q, k, v, dropout_p=0.0, **options).transpose(1, 2))
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "flex_attention called without torch.compile")  # meant: unfused here
        actual = flex_explicit_attention(q, k, v, runs=runs, kernel=flex_attention, **options)
    assert_close(actual, expected, terms=hd + 2 * s, what="attention")
    capped, uncapped = (_explicit_attention(q, k, v, dropout_p=0.0, **{**options, "softcap": cap})
                        for cap in (2.0, 1e4))
    assert (capped - uncapped).abs().max() > 1e-2  # the cap bends these scores


# ---- the chunked losses apply the logits' cap -------------------------------------------------------------------


def test_the_chunked_losses_equal_the_whole_soft_capped_logits(reference_and_model):
    """Token loss and DPO's sequence log-probabilities, chunked, against the model's whole (capped) logits: values
    and gradients."""
    _, model = reference_and_model
    labels = torch.roll(TOKENS, -1, dims=1)
    labels[:, :3] = IGNORE_INDEX
    terms = llama_terms(model.args, TOKENS.shape[1], labels.numel())
    for whole_of, chunked_head in ((lambda logits: cross_entropy_sum(logits, labels), ChunkedCrossEntropy(labels, 3)),
                                   (lambda logits: sequence_logps(logits, labels).sum(),
                                    ChunkedSequenceLogProbs(labels, 3))):
        results = []
        for run in (lambda: whole_of(model(TOKENS)), lambda: model(TOKENS, head=chunked_head).sum()):
            model.zero_grad()
            value = run()
            value.backward()
            results.append((value.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}))
        (whole, whole_grads), (chunked, chunked_grads) = results
        assert_close(chunked, whole, terms=terms, what=f"{type(chunked_head).__name__}: value")
        for name, grad in whole_grads.items():
            assert_close(chunked_grads[name], grad, terms=terms, what=f"{type(chunked_head).__name__}: {name}")
    # The head is told the cap: the same head ignoring it gives another loss.
    with torch.no_grad():
        uncapped = model(TOKENS, head=lambda hidden, weight, softcap: ChunkedCrossEntropy(labels, 3)(hidden, weight))
        assert abs(float(uncapped) - float(cross_entropy_sum(model(TOKENS), labels))) > 1.0


# ---- tune migrate: torchtune 0.6.1's gemma2 configs ---------------------------------------------------------------

# recipes/configs/gemma2/9B_full.yaml of torchtune 0.6.1, its keys that matter here.
TORCHTUNE_9B_FULL = """\
output_dir: /tmp/torchtune/gemma2_9B/full
tokenizer:
  _component_: torchtune.models.gemma.gemma_tokenizer
  path: {checkpoint}/tokenizer.model
dataset:
  _component_: torchtune.datasets.alpaca_dataset
  packed: False
seed: null
shuffle: True
model:
  _component_: torchtune.models.gemma2.gemma2_9b
checkpointer:
  _component_: torchtune.training.FullModelHFCheckpointer
  checkpoint_dir: {checkpoint}/
  checkpoint_files:
    filename_format: model-{{}}-of-{{}}.safetensors
    max_filename: "00008"
  recipe_checkpoint: null
  output_dir: ${{output_dir}}
  model_type: GEMMA2
resume_from_checkpoint: False
batch_size: 1
epochs: 1
optimizer:
  _component_: torch.optim.AdamW
  fused: True
  lr: 2e-5
loss:
  _component_: torchtune.modules.loss.LinearCrossEntropyLoss
max_steps_per_epoch: null
gradient_accumulation_steps: 1
clip_grad_norm: null
compile: False
optimizer_in_bwd: False
device: cuda
enable_activation_checkpointing: True
enable_activation_offloading: False
dtype: bf16
"""


def test_torchtunes_gemma2_config_migrates_to_the_published_model_and_validates(tmp_path, capsys):
    source = tmp_path / "9B_full.yaml"
    source.write_text(TORCHTUNE_9B_FULL.format(checkpoint=tmp_path / "gemma-2-9b"))
    assert main(["migrate", str(source), "-o", str(tmp_path / "ours.yaml")]) == 0
    out = capsys.readouterr().out
    assert "changed: model._component_: torchtune's gemma2 builders cap attention scores at 30 and logits at 50" in out
    assert "torchtune_ac.models.gemma2_9b" in (tmp_path / "ours.yaml").read_text()
    assert main(["validate", "--config", str(tmp_path / "ours.yaml")]) == 0
    assert "torchtune_ac.models.gemma2_9b: 9,241,705,984 parameters, 42 layers" in capsys.readouterr().out
