"""The KV cache under every attention variant a family has: sliding windows (Mistral, Phi-3, Gemma 2 and 3, gpt-oss;
a 6-token window, shorter than the rows decoded), soft-capped scores (Gemma 2) and attention sinks (gpt-oss). Greedy
generation of a left-padded batch equals, token for token, the argmax of the model's own full-sequence forward run
again on each prompt alone at every step (no cache, no padding); how often rows are checked for the end changes
nothing. The logits of every cached step equal the full forward's within rounding, which also catches a cap or a
sink too small to move an argmax."""

import pytest
import torch
from hf_families import write_hf_checkpoint
from numerics import assert_close, llama_terms

from torchtune_ac.generation import SamplingConfig, generate
from torchtune_ac.generation.decode import _decode_step, kv_caches
from torchtune_ac.generation.kv_cache import DecodeState
from torchtune_ac.models import load_hf
from torchtune_ac.models.llama import Attention

PROMPTS = [[5, 17, 23, 9], [88, 9, 41, 30, 7, 12, 19], [40], [3, 3, 3]]
MAX_NEW = 8  # prompts + completions stay within Phi-3's short LongRoPE range (16 positions)
# family -> config overrides (Mistral's window is off in the shared tiny config)
FAMILIES = {"mistral": {"sliding_window": 6}, "phi3": {}, "gemma2": {}, "gemma3": {}, "gpt_oss": {}}


def greedy_by_full_forward(model, prompt, eos):
    tokens = list(prompt)
    with torch.no_grad():
        for _ in range(MAX_NEW):
            tokens.append(int(model(torch.tensor([tokens]))[0, -1].argmax()))
            if tokens[-1] == eos:
                break
    return tokens[len(prompt):]


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def model(request, tmp_path_factory):
    root = tmp_path_factory.mktemp(request.param)
    return load_hf(write_hf_checkpoint(request.param, root, seed=4, **FAMILIES[request.param])).eval()


def test_greedy_with_the_cache_equals_the_full_forward(model):
    first = greedy_by_full_forward(model, PROMPTS[0], eos=-1)
    eos = first[2]  # a token this model emits, so that at least one row stops early
    expected = [greedy_by_full_forward(model, p, eos) for p in PROMPTS]
    config = SamplingConfig(max_new_tokens=MAX_NEW, temperature=0)
    for check_every in (1, 3):
        done = generate(model, PROMPTS, config, eos_ids=[eos], pad_id=0, check_every=check_every)
        assert done.tokens == expected, check_every
        assert done.truncated == [t[-1] != eos for t in expected]


@torch.no_grad()
def test_every_cached_steps_logits_equal_the_full_forwards(model):
    continuation = torch.randint(0, model.args.vocab_size, (len(PROMPTS), MAX_NEW),
                                 generator=torch.Generator().manual_seed(0))
    width = max(map(len, PROMPTS))
    tokens = torch.tensor([[0] * (width - len(p)) + p for p in PROMPTS])
    valid = torch.tensor([[False] * (width - len(p)) + [True] * (len(p) + MAX_NEW) for p in PROMPTS])
    positions = (valid.long().cumsum(dim=-1) - 1).clamp(min=0)
    state = DecodeState(valid, [m.window for m in model.modules() if isinstance(m, Attention)])
    cached = []
    with kv_caches(model, state):
        state.point(torch.arange(width))
        cached.append(_decode_step(model, tokens, positions[:, :width]))
        for step in range(MAX_NEW - 1):
            state.point(torch.tensor([width + step]))
            cached.append(_decode_step(model, continuation[:, step:step + 1], positions[:, width + step:][:, :1]))
    cached = torch.stack(cached, dim=1)  # [b, MAX_NEW, vocab]
    for row, prompt in enumerate(PROMPTS):
        full = model(torch.cat([torch.tensor(prompt), continuation[row, :-1]])[None])[0, len(prompt) - 1:]
        assert_close(cached[row], full, terms=llama_terms(model.args, len(prompt) + MAX_NEW, 1, backward=False),
                     what=f"row {row}")
