"""Generation with the KV cache: greedy decoding equals a decode that runs the whole sequence each step without a
cache, and transformers' ``generate`` on the same checkpoint (left-padded batch, attention mask); top-k 1 sampling
is greedy; a seeded sampler repeats itself and draws from the softmax; the compiled step decodes as the eager one,
with LoRA adapters too."""

import copy
import dataclasses

import pytest
import torch
from models_testlib import TINY, build_random_hf_llama

from torchtune_ac.generation import SamplingConfig, decode, generate
from torchtune_ac.lora.config import AdapterConfig
from torchtune_ac.lora.mechanism import adapted_linears, apply_adapters, initialize_adapters_
from torchtune_ac.models import load_hf

ARGS = dataclasses.replace(TINY, vocab_size=512)
PROMPTS = [[5, 17, 230], [88, 9, 41, 300, 7, 12, 19], [400], [3, 3, 3, 3]]
EOS = 7  # a token the random model emits often enough to stop some rows early


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("gen")
    hf = build_random_hf_llama(ARGS, seed=3)
    hf.save_pretrained(root)
    return load_hf(root).eval(), hf.eval()


def greedy_without_cache(model, prompt, max_new):
    tokens = list(prompt)
    with torch.no_grad():
        for _ in range(max_new):
            nxt = int(model(torch.tensor([tokens]))[0, -1].argmax())
            tokens.append(nxt)
            if nxt == EOS:
                break
    return tokens[len(prompt):]


def test_greedy_with_the_cache_equals_greedy_without(models):
    ours, _ = models
    done = generate(ours, PROMPTS, SamplingConfig(max_new_tokens=12, temperature=0), eos_ids=[EOS], pad_id=0)
    assert done.tokens == [greedy_without_cache(ours, p, 12) for p in PROMPTS]
    assert done.truncated == [t[-1] != EOS for t in done.tokens]
    assert any(len(t) == 12 for t in done.tokens)


def test_greedy_equals_transformers_generate(models):
    ours, hf = models
    width = max(map(len, PROMPTS))
    ids = torch.tensor([[0] * (width - len(p)) + p for p in PROMPTS])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in PROMPTS])
    with torch.no_grad():
        theirs = hf.generate(input_ids=ids, attention_mask=mask, do_sample=False, max_new_tokens=12,
                             eos_token_id=EOS, pad_token_id=0)[:, width:].tolist()
    expected = []
    for row in theirs:
        expected.append(row[:row.index(EOS) + 1] if EOS in row else row)
    done = generate(ours, PROMPTS, SamplingConfig(max_new_tokens=12, temperature=0), eos_ids=[EOS], pad_id=0)
    assert done.tokens == expected


def test_sampling_top_k_one_is_greedy_and_a_seed_repeats(models):
    ours, _ = models
    greedy = generate(ours, PROMPTS, SamplingConfig(max_new_tokens=6, temperature=0), eos_ids=[EOS], pad_id=0)
    top1 = generate(ours, PROMPTS, SamplingConfig(max_new_tokens=6, temperature=0.9, top_k=1), eos_ids=[EOS],
                    pad_id=0, generator=torch.Generator().manual_seed(1))
    assert top1.tokens == greedy.tokens

    def sampled(seed):
        return generate(ours, PROMPTS * 2, SamplingConfig(max_new_tokens=8, temperature=1.0, top_p=0.9),
                        eos_ids=[EOS], pad_id=0, generator=torch.Generator().manual_seed(seed)).tokens

    first = sampled(5)
    assert first == sampled(5)
    assert first != sampled(6)


@pytest.mark.parametrize("config, kept", [
    (SamplingConfig(1, temperature=1.0), 6),
    (SamplingConfig(1, temperature=0.5, top_k=3), 3),
])
def test_the_sampler_draws_from_the_softmax_of_the_kept_logits(config, kept):
    """200,000 draws from one row: each token's frequency is its softmax probability (of the logits over the
    temperature, the top-k kept) within 0.005 (5 standard deviations at most), the dropped tokens never drawn."""
    logits = torch.tensor([2.0, 1.5, 1.0, 0.0, -1.0, -3.0])
    n = 200_000
    drawn = decode.sample_next(logits.expand(n, -1), config, torch.Generator().manual_seed(0))
    frequencies = torch.bincount(drawn, minlength=6).double() / n
    expected = torch.zeros(6, dtype=torch.float64)
    expected[:kept] = (logits[:kept].double() / config.temperature).softmax(-1)
    torch.testing.assert_close(frequencies, expected, atol=0.005, rtol=0)



@pytest.mark.slow
def test_compiled_decoding_is_greedy_as_eager_with_adapters_and_reuses_its_code_across_prompt_widths(models):
    """GRPO's LoRA policy with generation.compile: adapters (B not zero) on every linear of the blocks (q/k/v in
    one group) decode in the compiled step as eagerly, and not as the base. Two prompt batches of different widths
    whose caches round up to the same multiple (7 + 12 and 5 + 12 slots: 32 each) run one compiled step: the second
    would fail on a recompile. (One compile, a minute on a cold cache: the plain model's compiled decoding is
    checked through the recipe in tests/integration/test_grpo_runs.py.)"""
    ours, _ = models
    adapted = copy.deepcopy(ours)
    apply_adapters(adapted, AdapterConfig(rank=4, alpha=16, targets=["q_proj", "k_proj", "v_proj", "o_proj",
                                                                      "gate_proj", "up_proj", "down_proj"]))
    initialize_adapters_(adapted, seed=0)
    with torch.no_grad():
        for _, linear in adapted_linears(adapted):
            linear.lora_b.weight.normal_(0, 0.2, generator=torch.Generator().manual_seed(1))
    torch._dynamo.reset()
    config = SamplingConfig(max_new_tokens=12, temperature=0)
    narrower = [p[:5] for p in PROMPTS]
    multiple = decode.COMPILED_CACHE_MULTIPLE
    assert -(-(7 + 12) // multiple) == -(-(5 + 12) // multiple)
    compiled = generate(adapted, PROMPTS, config, eos_ids=[EOS], pad_id=0, compile_decode=True)
    with torch.compiler.set_stance("fail_on_recompile"):
        compiled_narrower = generate(adapted, narrower, config, eos_ids=[EOS], pad_id=0, compile_decode=True)
    assert compiled == generate(adapted, PROMPTS, config, eos_ids=[EOS], pad_id=0)
    assert compiled_narrower == generate(adapted, narrower, config, eos_ids=[EOS], pad_id=0)
    assert compiled != generate(ours, PROMPTS, config, eos_ids=[EOS], pad_id=0)
