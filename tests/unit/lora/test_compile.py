"""Adapted blocks under ``torch.compile``: Dynamo breaks no graph, with LoRA,
DoRA and QLoRA's NF4 base, under no AC and per-op AC, and forward and backward give eager's numbers."""

import pytest
import torch
from compile_testlib import compile_blocks_counted, graphs_and_breaks
from models_testlib import build_random_llama

from torchtune_ac.activation_checkpointing.mechanism import ACMode, ac_plan, apply_ac_plan
from torchtune_ac.lora.config import AdapterConfig, AdapterKind, QuantizeBase
from torchtune_ac.lora.mechanism import apply_adapters
from torchtune_ac.lora.weights import load_or_initialize_adapters_
from torchtune_ac.models import LlamaArgs

# 128 x 128 projections: whole NF4 blocks (64 x 256) for QLoRA.
ARGS = LlamaArgs(vocab_size=96, dim=128, n_layers=2, n_heads=4, n_kv_heads=4, intermediate_dim=128, max_seq_len=64)
CASES = {
    "lora, no AC": (AdapterConfig(targets=["q_proj", "v_proj", "down_proj"]), "none", None),
    "dora, per-op AC": (AdapterConfig(kind=AdapterKind.DORA, targets=["q_proj", "v_proj", "down_proj"]),
                        "selective", "op"),
    "qlora, per-op AC": (AdapterConfig(targets=["q_proj", "o_proj"], quantize_base=QuantizeBase.NF4),
                         "selective", "op"),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_adapted_blocks_compile_to_one_graph_without_breaks_and_eagers_numbers(name):
    config, mode, option = CASES[name]
    tokens = torch.randint(0, ARGS.vocab_size, (2, 16), generator=torch.Generator().manual_seed(1))
    results = {}
    for compiled in (False, True):
        model = build_random_llama(ARGS, seed=1).train()
        apply_adapters(model, config)
        load_or_initialize_adapters_(model, config, seed=0)
        with torch.no_grad():  # B nonzero: the adapters' path counts in the numbers compared
            for name_, param in model.named_parameters():
                if "lora_b" in name_:
                    param.copy_(torch.randn(param.shape, generator=torch.Generator().manual_seed(2)) * 0.1)
        apply_ac_plan(model, ac_plan(ACMode(mode), option, len(model.layers)))
        compile_blocks_counted(model, compiled)
        logits = model(tokens)
        logits.square().mean().backward()
        results[compiled] = (logits.detach(), [p.grad for p in model.parameters() if p.requires_grad])
    # Two graphs, no break: the first block's input needs no gradient (the embeddings are frozen), every later
    # block's does.
    assert graphs_and_breaks() == (2, {})
    assert torch.equal(results[True][0], results[False][0])
    assert all(torch.equal(a, b) for a, b in zip(results[True][1], results[False][1]))
