"""QLoRA's base: each adapted linear's weight becomes torchao's NF4Tensor, whose dequantised values are torchao's own
quantisation of the loaded weight, frozen; the model computes with exactly those values, and only the adapters
take gradients."""

import copy

import pytest
import torch
from models_testlib import build_random_llama

from torchtune_ac.lora.config import AdapterConfig, AdapterKind, QuantizeBase
from torchtune_ac.lora.mechanism import (
    NF4_BLOCK,
    NF4_SCALER_BLOCK,
    adapted_linears,
    adapters_off,
    apply_adapters,
    base_only,
    initialize_adapters_,
    quantize_base_,
)
from torchtune_ac.lora.weights import load_or_initialize_adapters_
from torchtune_ac.models import LlamaArgs

torchao_quantization = pytest.importorskip("torchao.quantization")

# 128 x 128 projections: 16,384 weights, whole NF4 blocks of 64 x 256.
ARGS = LlamaArgs(vocab_size=96, dim=128, n_layers=2, n_heads=4, n_kv_heads=4, intermediate_dim=128, max_seq_len=64)
TOKENS = torch.randint(0, 96, (2, 10), generator=torch.Generator().manual_seed(0))


def test_the_nf4_base_is_torchaos_quantisation_and_only_the_adapters_train():
    model = build_random_llama(ARGS, seed=1)
    apply_adapters(model, AdapterConfig(targets=["q_proj", "o_proj", "gate_proj"]))
    initialize_adapters_(model, seed=0)
    dense = {name: linear.weight.detach().clone() for name, linear in adapted_linears(model)}

    quantised = quantize_base_(model)

    assert quantised == sum(w.numel() for w in dense.values()) == 3 * ARGS.n_layers * 128 * 128
    dequantised = copy.deepcopy(dense)
    for name, linear in adapted_linears(model):
        weight = linear.weight
        assert isinstance(weight, torchao_quantization.NF4Tensor) and not weight.requires_grad
        expected = torchao_quantization.to_nf4(dense[name], NF4_BLOCK, NF4_SCALER_BLOCK).get_original_weight()
        assert torch.equal(weight.get_original_weight(), expected), name
        assert not torch.equal(expected, dense[name])  # 4 bits a weight: it did change
        dequantised[name] = expected
        # 4 bits a weight, plus the scales (8 bits a block of 64) and their scales (fp32 a block of 256).
        stored = sum(t.numel() * t.element_size() for t in (weight.quantized_data, weight.quantized_scalers,
                                                             weight.quantization_factor))
        assert stored / weight.numel() == pytest.approx(0.5 + 1 / 64 + 4 / (64 * 256))

    # The same model with the dequantised weights stored dense computes the same logits bit for bit (the NF4 matmul
    # dequantises, then runs the same linear).
    reference = copy.deepcopy(model)
    with torch.no_grad():
        for name, linear in adapted_linears(reference):
            linear.weight = torch.nn.Parameter(dequantised[name], requires_grad=False)
    logits = model(TOKENS)
    assert torch.equal(logits, reference(TOKENS))
    logits.sum().backward()
    trained = {n for n, p in model.named_parameters() if p.grad is not None}
    assert trained == {n for n, _ in model.named_parameters() if ".lora_" in n}
    with base_only(model):
        assert not any(".lora_" in n for n in model.state_dict())


def test_dora_on_the_nf4_base_starts_at_that_base():
    """QDoRA: the base is quantised before the adapters' values are drawn, so DoRA's magnitude is the NF4 rows'
    norms and step 0 computes the NF4 base bit for bit."""
    model = build_random_llama(ARGS, seed=1)
    config = AdapterConfig(kind=AdapterKind.DORA, targets=["q_proj", "o_proj"], quantize_base=QuantizeBase.NF4)
    apply_adapters(model, config)
    load_or_initialize_adapters_(model, config, seed=0)
    logits = model(TOKENS)
    with torch.no_grad(), adapters_off(model):
        assert torch.equal(logits.detach(), model(TOKENS))
    logits.sum().backward()
    assert {n for n, p in model.named_parameters() if p.grad is not None} == {
        n for n, _ in model.named_parameters() if ".lora_" in n}


@pytest.mark.parametrize("kind", [AdapterKind.LORA, AdapterKind.DORA])
def test_the_merged_export_of_an_nf4_base_is_its_dequantised_weight_plus_the_adapters(kind, tmp_path):
    """``adapter.save_merged`` with an NF4 base: each adapted weight is written dense, in the base's dtype, as the
    dequantised NF4 weight with the adapter merged in (``W_nf4 + s B A``; for DoRA each row rescaled to its
    magnitude), and transformers, loading the folder alone, computes this model's logits."""
    from transformers import AutoModelForCausalLM

    from numerics import assert_close, llama_terms
    from torchtune_ac.checkpoint.hf import save_hf_files
    from torchtune_ac.lora.export import merged_model_files
    from torchtune_ac.lora.mechanism import merge_rows
    from torchtune_ac.models.families import require_family

    model = build_random_llama(ARGS, seed=1)
    config = AdapterConfig(kind=kind, targets=["q_proj", "o_proj", "down_proj"], quantize_base=QuantizeBase.NF4)
    apply_adapters(model, config)
    load_or_initialize_adapters_(model, config, seed=0)
    with torch.no_grad():  # B random, not zero: the adapters change the logits
        for _, linear in adapted_linears(model):
            linear.lora_b.weight.normal_(0, 0.05, generator=torch.Generator().manual_seed(2))
        logits = model(TOKENS)
        with adapters_off(model):
            base = model(TOKENS)

    files, family = merged_model_files(model), require_family(model, "the test")
    for name, linear in adapted_linears(model):
        merged = files.tensors[family.hf.to_hf_name(f"{name}.weight")]
        dequantised = linear.weight.get_original_weight()
        assert type(merged) is torch.Tensor and merged.dtype == linear.weight.dtype == torch.float32, name
        assert torch.equal(merged, merge_rows(dequantised, linear.lora_b.weight, linear.lora_a.weight,
                                              linear.lora_magnitude, linear.lora_scale)), name
    save_hf_files(files, tmp_path / "merged")
    with torch.no_grad():
        loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "merged").eval()(input_ids=TOKENS).logits
    assert not torch.equal(logits, base)
    assert_close(loaded, logits, terms=llama_terms(ARGS, TOKENS.shape[1], 0, backward=False), what="merged logits")


# ----------------------------------------------------------------------------------------------- under FSDP2

# MLP projections of 256 x 128 and 128 x 256: two row shards of 16,384 weights each, whole NF4 blocks.
SHARDABLE = LlamaArgs(vocab_size=96, dim=128, n_layers=2, n_heads=4, n_kv_heads=4, intermediate_dim=256,
                      max_seq_len=64)
QDORA = AdapterConfig(kind=AdapterKind.DORA, targets=["gate_proj", "up_proj", "down_proj"],
                      quantize_base=QuantizeBase.NF4)


def _qlora_trains_like_one_process(rank: int) -> None:
    import torch.distributed as dist
    from numerics import assert_close, assert_steps_alike, assert_weights_trained_alike, llama_terms
    from parallel_testlib import CPU, LENGTH, ROWS, STEPS, Case, train

    from torchtune_ac.lora.sharded_nf4 import is_sharded_nf4
    from torchtune_ac.lora.mechanism import merge_rows, merged_weight, whole
    from torchtune_ac.models.families.llama import FAMILY
    from torchtune_ac.run.assemble import AssemblyPlan, build_training
    from torchtune_ac.runtime.distributed import DistributedContext
    from torchtune_ac.runtime.dtypes import DType
    from torchtune_ac.runtime.parallelism import Parallelism

    class QLoRACase(Case):
        args = SHARDABLE
        family = FAMILY

    case = QLoRACase("qdora")

    def assemble(ctx, parallelism):
        with torch.device("meta"):
            model = FAMILY.build(SHARDABLE)
        plan = AssemblyPlan(dtype=DType.FP32, memory=case.memory(), parallelism=parallelism, seed=7, adapter=QDORA)
        return build_training(model, plan, ctx=ctx, make_optimizer=lambda params: torch.optim.AdamW(params, lr=1e-2))

    def trained(assembled, ctx, dp_rank, dp_degree):
        result = train(case, assembled, ctx, dp_rank, dp_degree)
        adapters = {n: whole(p.detach()).clone() for n, p in assembled.model.named_parameters() if p.requires_grad}
        return result, adapters

    def one_process():
        assembled = assemble(alone, Parallelism(1))
        bases = {name: linear.dense_weight().clone() for name, linear in adapted_linears(assembled.model)}
        return trained(assembled, alone, 0, 1), bases

    alone = DistributedContext(0, 1, 0, CPU)
    handed = [one_process() if rank == 0 else None]
    dist.broadcast_object_list(handed, src=0)
    ((losses, norms), adapters), bases = handed[0]
    ctx = DistributedContext(rank, 2, 0, CPU)
    split = assemble(ctx, Parallelism(2))
    weights = [linear.weight for _, linear in adapted_linears(split.model)]
    assert len(weights) == 3 * SHARDABLE.n_layers and all(is_sharded_nf4(w) for w in weights)
    (split_losses, split_norms), split_adapters = trained(split, ctx, rank, 2)
    terms = llama_terms(SHARDABLE, LENGTH, ROWS * LENGTH)
    assert_steps_alike(split_losses, losses, terms=terms, what="QDoRA on 2 processes: loss")
    assert_steps_alike(split_norms, norms, terms=terms, what="QDoRA on 2 processes: gradient norm")
    assert_weights_trained_alike(split_adapters, adapters, lrs=[1e-2] * STEPS, terms=terms)
    # save_merged: each rank merges its own NF4 rows, dequantised, which are the rows of the one process's base.
    for name, linear in adapted_linears(split.model):
        merged = merged_weight(linear)
        assert merged.placements == linear.weight.placements, name
        expected = merge_rows(bases[name], whole(linear.lora_b.weight), whole(linear.lora_a.weight),
                              whole(linear.lora_magnitude), linear.lora_scale)
        assert_close(merged.full_tensor(), expected, terms=QDORA.rank + SHARDABLE.dim, what=name)


@pytest.mark.distributed
def test_qlora_under_fsdp2_trains_like_one_process(tmp_path):
    """The NF4 base sharded by FSDP2 (torchao's NF4 all-gather) over 2 gloo processes: the same losses, gradient
    norms and adapters as one process, DoRA's magnitude rows sharded with the base's."""
    from gloo_testlib import run_on_gloo_ranks

    run_on_gloo_ranks(_qlora_trains_like_one_process, store_dir=tmp_path)


def test_a_shard_degree_that_cannot_split_the_nf4_blocks_is_refused_naming_the_layer():
    from torchtune_ac.errors import UserError
    from torchtune_ac.lora.mechanism import find_targets
    from torchtune_ac.lora.sharded_nf4 import check_nf4_sharding
    from torchtune_ac.models.llama import Llama

    with torch.device("meta"):
        shardable, whole_blocks_only = Llama(SHARDABLE), Llama(ARGS)
    check_nf4_sharding(find_targets(shardable, QDORA), 2)
    with pytest.raises(UserError, match=r"over 2 processes: layers\.0\.attn\.q_proj\.weight \(128, 128\) does not "):
        check_nf4_sharding(find_targets(whole_blocks_only, AdapterConfig(targets=["q_proj"])), 2)
