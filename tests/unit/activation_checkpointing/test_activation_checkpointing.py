"""Activation checkpointing: plan resolution (every valid and invalid key combination), applying a plan,
exact dropout replay, recompute cost (FLOPs), the per-op policy, and composition with torch.compile."""

import functools
import logging

import pytest
import torch
import torch.nn.functional as F
from numerics import assert_all_close, assert_close, llama_terms
from torch import nn
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts
from torch.utils.flop_counter import FlopCounterMode

from torchtune_ac.errors import UserError
from torchtune_ac.models.attention import document_runs
from torchtune_ac.models.llama import Llama, LlamaArgs, positions_from_document_ids
from torchtune_ac.activation_checkpointing.config import ACConfigError, resolve_ac_plan, setup_activation_checkpointing
from torchtune_ac.activation_checkpointing.mechanism import (
    PROFILER_OPS,
    SAVED_OPS,
    ACMode,
    ACPlan,
    CheckpointedForward,
    _resolve_aten_ops,
    apply_ac_plan,
    is_checkpointed,
    save_matmuls_and_attention,
    silence_compiled_policy_warning,
)

VOCAB = 128


def build_tiny(n_layers: int = 4, dropout: float = 0.0, seed: int = 0) -> Llama:
    torch.manual_seed(seed)
    args = LlamaArgs(
        vocab_size=VOCAB,
        dim=32,
        n_layers=n_layers,
        n_heads=4,
        n_kv_heads=2,
        intermediate_dim=64,
        max_seq_len=64,
        attn_dropout=dropout,
        resid_dropout=dropout,
    )
    model = Llama(args)
    model.init_weights()
    return model


def resolve(enable=None, mode=None, option=None, n_layers=8) -> ACPlan:
    return resolve_ac_plan(enable_activation_checkpointing=enable, ac_mode=mode, ac_option=option, n_layers=n_layers)


# (enable, ac_mode, ac_option, n_layers) -> (mode, option, checkpointed blocks, str(plan))
VALID = [
    (None, None, None, 8, ACMode.NONE, None, (), "none"),
    (False, None, None, 8, ACMode.NONE, None, (), "none"),
    (True, None, None, 8, ACMode.FULL, None, tuple(range(8)), "full: all 8 blocks"),
    (None, "none", None, 8, ACMode.NONE, None, (), "none"),
    (False, "none", None, 8, ACMode.NONE, None, (), "none"),
    (None, "full", None, 8, ACMode.FULL, None, tuple(range(8)), "full: all 8 blocks"),
    (True, "full", None, 8, ACMode.FULL, None, tuple(range(8)), "full: all 8 blocks"),
    (None, "FULL", None, 8, ACMode.FULL, None, tuple(range(8)), "full: all 8 blocks"),
    (None, " Full ", None, 8, ACMode.FULL, None, tuple(range(8)), "full: all 8 blocks"),
    (None, ACMode.FULL, None, 8, ACMode.FULL, None, tuple(range(8)), "full: all 8 blocks"),
    (None, "full", None, 1, ACMode.FULL, None, (0,), "full: all 1 block"),
    (
        None, "selective", 2, 8, ACMode.SELECTIVE, 2, (1, 3, 5, 7),
        "selective every 2nd block: 4 of 8 blocks [1, 3, 5, 7]",
    ),
    (
        True, "selective", 1, 8, ACMode.SELECTIVE, 1, tuple(range(8)),
        "selective every 1st block: 8 of 8 blocks [0, 1, 2, 3, 4, 5, 6, 7]",
    ),
    (None, "selective", 3, 8, ACMode.SELECTIVE, 3, (2, 5), "selective every 3rd block: 2 of 8 blocks [2, 5]"),
    (None, "Selective", 4, 8, ACMode.SELECTIVE, 4, (3, 7), "selective every 4th block: 2 of 8 blocks [3, 7]"),
    (None, "selective", 8, 8, ACMode.SELECTIVE, 8, (7,), "selective every 8th block: 1 of 8 blocks [7]"),
    (None, "selective", 11, 12, ACMode.SELECTIVE, 11, (10,), "selective every 11th block: 1 of 12 blocks [10]"),
    (None, "selective", 5, 32, ACMode.SELECTIVE, 5, (4, 9, 14, 19, 24, 29), None),
    # A quoted YAML number is accepted as k.
    (None, "selective", "2", 8, ACMode.SELECTIVE, 2, (1, 3, 5, 7), None),
    (None, "selective", " 3 ", 8, ACMode.SELECTIVE, 3, (2, 5), None),
    (
        None, "selective", "op", 8, ACMode.SELECTIVE, "op", tuple(range(8)),
        "selective per-op (save matmuls and attention, recompute the rest): all 8 blocks",
    ),
    (None, "selective", "OP", 4, ACMode.SELECTIVE, "op", tuple(range(4)), None),
]


@pytest.mark.parametrize("enable, mode, option, n_layers, want_mode, want_option, want_blocks, want_str", VALID)
def test_resolve_valid(enable, mode, option, n_layers, want_mode, want_option, want_blocks, want_str):
    plan = resolve(enable, mode, option, n_layers)
    assert plan.mode is want_mode
    assert plan.option == want_option
    assert plan.checkpointed_blocks == want_blocks
    assert plan.n_layers == n_layers
    assert (plan.policy is save_matmuls_and_attention) == (want_option == "op")
    if want_str is not None:
        assert str(plan) == want_str


# (enable, ac_mode, ac_option, n_layers) -> substrings of the single problem reported
INVALID = [
    (None, "partial", None, 8, ["ac_mode='partial'", "unknown mode", "none, full, selective"]),
    (None, "", None, 8, ["ac_mode=''", "unknown mode"]),
    (None, 2, None, 8, ["ac_mode=2", "unknown mode"]),
    (None, True, None, 8, ["ac_mode=true", "unknown mode"]),
    (False, "full", None, 8, ["enable_activation_checkpointing=false contradicts ac_mode=full", "ac_mode: none"]),
    (False, "selective", 2, 8, ["enable_activation_checkpointing=false contradicts ac_mode=selective"]),
    (True, "none", None, 8, ["enable_activation_checkpointing=true contradicts ac_mode=none", "full or selective"]),
    ("yes", None, None, 8, ["enable_activation_checkpointing='yes'", "true or false"]),
    (1, None, None, 8, ["enable_activation_checkpointing=1", "true or false"]),
    (None, "full", 2, 8, ["ac_option=2", "only allowed with ac_mode: selective", "ac_mode is full"]),
    (None, "none", "op", 8, ["ac_option='op'", "only allowed with ac_mode: selective", "ac_mode is none"]),
    (True, None, 2, 8, ["ac_option=2", "enable_activation_checkpointing=true alone means full"]),
    (None, None, 2, 8, ["ac_option=2", "ac_mode is not set"]),
    (None, "selective", None, 8, ["ac_mode=selective requires ac_option", "between 1 and 8", "'op'"]),
    (None, "selective", 0, 8, ["ac_option=0: must be between 1 and 8 (the model has 8 layers)"]),
    (None, "selective", -1, 8, ["ac_option=-1: must be between 1 and 8 (the model has 8 layers)"]),
    (None, "selective", 12, 8, ["ac_option=12: must be between 1 and 8 (the model has 8 layers)"]),
    (None, "selective", 2, 1, ["ac_option=2: must be between 1 and 1 (the model has 1 layer)"]),
    (None, "selective", "12", 8, ["ac_option=12: must be between 1 and 8"]),
    (None, "selective", "0", 8, ["ac_option=0: must be between 1 and 8"]),
    (None, "selective", 2.0, 8, ["ac_option=2.0", "not float"]),
    (None, "selective", 0.5, 8, ["ac_option=0.5", "not float"]),
    (None, "selective", True, 8, ["ac_option=true", "a boolean is not allowed"]),
    (None, "selective", False, 8, ["ac_option=false", "a boolean is not allowed"]),
    (None, "selective", "two", 8, ["ac_option='two'", "unknown option", "between 1 and 8", "'op'"]),
    (None, "selective", "-1", 8, ["ac_option='-1'", "unknown option"]),
    (None, "selective", "2.5", 8, ["ac_option='2.5'", "unknown option"]),
    (None, "selective", "", 8, ["ac_option=''", "unknown option"]),
    (None, "selective", "²", 8, ["ac_option='²'", "unknown option"]),
    (None, "selective", [2], 8, ["ac_option=[2]", "not list"]),
]


@pytest.mark.parametrize("enable, mode, option, n_layers, fragments", INVALID)
def test_resolve_invalid(enable, mode, option, n_layers, fragments):
    with pytest.raises(ACConfigError) as info:
        resolve(enable, mode, option, n_layers)
    assert len(info.value.problems) == 1, info.value.problems
    for fragment in fragments:
        assert fragment in info.value.problems[0]
        assert fragment in str(info.value)


def test_resolve_lists_every_problem_in_one_user_error():
    with pytest.raises(UserError) as info:
        resolve(False, "sometimes", 9, 8)
    assert isinstance(info.value, ACConfigError)
    assert len(info.value.problems) == 2
    assert "ac_mode='sometimes'" in info.value.problems[0]
    assert "ac_option=9: must be between 1 and 8" in info.value.problems[1]
    with pytest.raises(ACConfigError) as info:
        resolve(False, "selective", "many", 8)
    assert [p.split(":")[0] for p in info.value.problems] == [
        "enable_activation_checkpointing=false contradicts ac_mode=selective",
        "ac_option='many'",
    ]


@pytest.mark.parametrize("n_layers", [0, -3, 2.0, True, None])
def test_resolve_rejects_a_bad_layer_count_as_a_caller_bug(n_layers):
    with pytest.raises(ValueError, match="n_layers must be a positive int"):
        resolve(True, None, None, n_layers)


def test_plans_are_values_and_immutable():
    assert resolve(None, "selective", 2) == resolve(None, "SELECTIVE", "2")
    assert resolve(None, "selective", "op") == resolve(None, "selective", "op")
    assert resolve(True) == resolve(None, "full")
    plan = resolve(None, "full")
    with pytest.raises(AttributeError):
        plan.n_layers = 4


def test_saved_ops_are_resolved_and_a_typo_fails_loudly():
    aten = torch.ops.aten
    for op in (aten.mm.default, aten.addmm.default, aten.bmm.default,
               aten._scaled_dot_product_flash_attention_for_cpu.default,
               aten._scaled_dot_product_flash_attention.default,
               aten._scaled_dot_product_efficient_attention.default,
               aten._scaled_dot_product_cudnn_attention.default):
        assert op in SAVED_OPS
        assert save_matmuls_and_attention(None, op) is CheckpointPolicy.MUST_SAVE
    for op in (aten.silu.default, aten.mul.Tensor, aten.rsqrt.default, aten.cat.default, aten.bernoulli_.float):
        assert save_matmuls_and_attention(None, op) is CheckpointPolicy.PREFER_RECOMPUTE
    with pytest.raises(AttributeError):
        _resolve_aten_ops(("mmm.default",))


def test_our_regions_leave_profiler_annotations_uncounted_and_torch_s_set_alone():
    """A recompute may run more profiler annotations than its forward did (FSDP2's root pre-forward inside a
    recomputed block): our per-op regions leave them out of the count, torch's own refuse the recompute, and
    importing and running ours leaves torch's process-wide ``SAC_IGNORED_OPS`` as torch ships it."""
    calls = []

    def forward(x: torch.Tensor) -> torch.Tensor:
        calls.append(None)
        for _ in calls:  # forward annotates once, the recompute twice
            with torch.autograd.profiler.record_function("annotation"):
                pass
        return (x @ x).sin()

    x = torch.randn(4, 4, generator=torch.Generator().manual_seed(0), requires_grad=True)
    CheckpointedForward(forward, save_matmuls_and_attention)(x).sum().backward()
    expected = torch.autograd.grad((x @ x).sin().sum(), x)[0]
    assert len(calls) == 2 and torch.equal(x.grad, expected)  # the same ops replayed: bit-exact
    assert PROFILER_OPS.isdisjoint(torch.utils.checkpoint.SAC_IGNORED_OPS)
    calls.clear()
    torch_contexts = functools.partial(create_selective_checkpoint_contexts, save_matmuls_and_attention)
    with pytest.raises(RuntimeError, match="_record_function"):
        checkpoint(forward, x, use_reentrant=False, context_fn=torch_contexts).sum().backward()


@pytest.mark.parametrize(
    "dropout, want_saved",
    [
        # 7 projections (q, k, v, o, gate, up, down) lower to mm; fused CPU flash attention.
        (0.0, {"mm.default": 7, "_scaled_dot_product_flash_attention_for_cpu.default": 1}),
        # Attention dropout on CPU takes the math path: q @ k^T and probs @ v are bmm.
        (0.1, {"mm.default": 7, "bmm.default": 2}),
    ],
)
def test_op_policy_saves_the_matmuls_the_cpu_forward_actually_runs(dropout, want_saved):
    model = build_tiny(n_layers=1, dropout=dropout)
    block = model.layers[0]
    saved: dict[str, int] = {}

    def counting_policy(ctx, op, *args, **kwargs):
        decision = save_matmuls_and_attention(ctx, op, *args, **kwargs)
        if decision is CheckpointPolicy.MUST_SAVE and not ctx.is_recompute:
            name = f"{op._opname}.{op._overloadname}"
            saved[name] = saved.get(name, 0) + 1
        return decision

    x = torch.randn(2, 16, 32, requires_grad=True)
    cos, sin = model.rope_cos_sin(torch.arange(16).expand(2, 16), x.dtype)
    out = checkpoint(
        block, x, cos, sin, use_reentrant=False,
        context_fn=functools.partial(create_selective_checkpoint_contexts, counting_policy),
    )
    out.sum().backward()
    assert saved == want_saved


@pytest.mark.parametrize(
    "mode, option", [(None, None), ("full", None), ("selective", 1), ("selective", 2), ("selective", "op")]
)
def test_apply_keeps_state_dict_and_checkpoints_exactly_the_planned_blocks(mode, option):
    reference = build_tiny()
    model = build_tiny()
    plan = setup_activation_checkpointing(model, ac_mode=mode, ac_option=option)
    assert list(model.state_dict()) == list(reference.state_dict())
    # Exact: both models drew their weights from the same seed, and applying AC computes nothing.
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), reference.state_dict().values()))
    assert [type(m) for m in model.modules()] == [type(m) for m in reference.modules()]
    assert tuple(i for i, block in enumerate(model.layers) if is_checkpointed(block)) == plan.checkpointed_blocks
    assert not is_checkpointed(model)


def test_applying_twice_is_an_error_and_changes_nothing():
    model = build_tiny()
    setup_activation_checkpointing(model, ac_mode="selective", ac_option=2)
    for mode, option in [("selective", 2), ("full", None), ("selective", "op"), ("none", None)]:
        with pytest.raises(RuntimeError, match=r"already applied to blocks \[1, 3\] of this model"):
            setup_activation_checkpointing(model, ac_mode=mode, ac_option=option)
    assert [is_checkpointed(b) for b in model.layers] == [False, True, False, True]


def test_apply_refuses_a_plan_for_another_layer_count():
    model = build_tiny(n_layers=4)
    with pytest.raises(ValueError, match="resolved for 8 layers but the model has 4"):
        apply_ac_plan(model, resolve(None, "full", None, n_layers=8))
    assert not any(is_checkpointed(b) for b in model.layers)


class NoLayers(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList([nn.Linear(2, 2)])


class ListLayers(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = [nn.Linear(2, 2)]


class EmptyLayers(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList()


@pytest.mark.parametrize(
    "model, fragment",
    [
        (NoLayers(), "NoLayers has no attribute 'layers'"),
        (ListLayers(), "ListLayers has 'layers' of type list"),
        (EmptyLayers(), "EmptyLayers has an empty 'layers'"),
    ],
)
def test_model_without_layers_is_a_user_error(model, fragment):
    with pytest.raises(UserError, match="non-empty nn.ModuleList of transformer blocks") as info:
        setup_activation_checkpointing(model, enable_activation_checkpointing=True)
    assert fragment in str(info.value)


def test_setup_resolves_against_the_built_model():
    with pytest.raises(ACConfigError, match=r"ac_option=5: must be between 1 and 4 \(the model has 4 layers\)"):
        setup_activation_checkpointing(build_tiny(n_layers=4), ac_mode="selective", ac_option=5)


def test_two_models_in_one_process_get_the_same_plan():
    plans, blocks = [], []
    for _ in range(2):
        model = build_tiny(n_layers=6)
        plans.append(setup_activation_checkpointing(model, ac_mode="selective", ac_option=2))
        blocks.append([i for i, b in enumerate(model.layers) if is_checkpointed(b)])
    assert plans[0] == plans[1]
    assert blocks == [[1, 3, 5], [1, 3, 5]]


def run_step(model: Llama, tokens: torch.Tensor, document_ids=None):
    """Loss and gradients of one forward+backward under a fixed RNG state."""
    torch.manual_seed(1234)
    logits = model(tokens[:, :-1], document_ids)
    loss = F.cross_entropy(logits.reshape(-1, VOCAB), tokens[:, 1:].reshape(-1))
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


AC_SETTINGS = [("full", None), ("selective", 1), ("selective", 2), ("selective", 3), ("selective", "op")]


@pytest.mark.numerics
@pytest.mark.parametrize("document_ids", [False, True], ids=["causal", "packed"])
def test_dropout_is_replayed_exactly_in_every_mode(document_ids):
    torch.manual_seed(0)
    tokens = torch.randint(0, VOCAB, (2, 33))
    doc = torch.tensor([[0] * 12 + [1] * 20, [0] * 32]) if document_ids else None

    ref_loss, ref_grads = run_step(build_tiny(n_layers=4, dropout=0.2), tokens, doc)
    # Dropout is really active: a different seed changes the loss.
    other = build_tiny(n_layers=4, dropout=0.2)
    torch.manual_seed(99)
    other_loss = F.cross_entropy(other(tokens[:, :-1], doc).reshape(-1, VOCAB), tokens[:, 1:].reshape(-1))
    assert not torch.equal(other_loss.detach(), ref_loss)
    for mode, option in AC_SETTINGS:
        model = build_tiny(n_layers=4, dropout=0.2)
        setup_activation_checkpointing(model, ac_mode=mode, ac_option=option)
        loss, grads = run_step(model, tokens, doc)
        # Bit for bit: one process, the same ops replayed in the same order (the recompute only repeats them).
        assert torch.equal(loss, ref_loss), (mode, option)
        for name, grad in ref_grads.items():
            assert torch.equal(grads[name], grad), (mode, option, name)


def count_step_flops(model: Llama, tokens: torch.Tensor) -> int:
    counter = FlopCounterMode(display=False)
    with counter:
        run_step(model, tokens)
    return counter.get_total_flops()


def test_recompute_flops_match_each_mode():
    n_layers = 4
    tokens = torch.randint(0, VOCAB, (2, 33))
    model = build_tiny(n_layers=n_layers)
    counter = FlopCounterMode(display=False)
    with counter:
        model(tokens[:, :-1])
    per_module = counter.get_flop_counts()
    block_forward = sum(sum(per_module[f"Llama.layers.{i}"].values()) for i in range(n_layers))
    assert block_forward > 0.5 * counter.get_total_flops()  # the blocks dominate; the rest is the output head

    baseline = count_step_flops(build_tiny(n_layers=n_layers), tokens)
    extra = {}
    for mode, option in [("full", None), ("selective", 2), ("selective", "op")]:
        model = build_tiny(n_layers=n_layers)
        setup_activation_checkpointing(model, ac_mode=mode, ac_option=option)
        extra[(mode, option)] = count_step_flops(model, tokens) - baseline
    # Full AC recomputes one forward of every block, except its last matmul (down_proj): non-reentrant AC
    # stops recomputing once every tensor backward needs exists, and down_proj's output is not needed.
    last_matmul = sum(sum(per_module[f"Llama.layers.{i}.mlp.down_proj"].values()) for i in range(n_layers))
    assert extra[("full", None)] == pytest.approx(block_forward - last_matmul, rel=0.01)
    assert extra[("full", None)] > 0.75 * block_forward
    # k=2 checkpoints half the blocks; per-op AC recomputes no matmul at all.
    assert extra[("selective", 2)] == pytest.approx(extra[("full", None)] / 2, rel=0.01)
    assert 0 <= extra[("selective", "op")] < 0.1 * block_forward


def compile_blocks_counting_calls(model: Llama) -> dict:
    """``block.compile()`` (inductor) on every block; the returned dict counts runs of the compiled forward."""
    from torch._inductor.compile_fx import compile_fx

    calls = {"forward": 0}

    def counting_inductor(graph_module, example_inputs):
        compiled = compile_fx(graph_module, example_inputs)

        def run(*args):
            calls["forward"] += 1
            return compiled(*args)

        return run

    torch._dynamo.reset()
    for block in model.layers:
        block.compile(backend=counting_inductor)
    return calls


@pytest.mark.slow
@pytest.mark.parametrize("mode, option", [("full", None), ("selective", "op")])
def test_compiled_blocks_match_eager(mode, option):
    torch.manual_seed(0)
    tokens = torch.randint(0, VOCAB, (2, 17))
    ref_loss, ref_grads = run_step(build_tiny(n_layers=2), tokens)
    model = build_tiny(n_layers=2)
    setup_activation_checkpointing(model, ac_mode=mode, ac_option=option)
    keys = list(model.state_dict())
    calls = compile_blocks_counting_calls(model)
    assert list(model.state_dict()) == keys
    loss, grads = run_step(model, tokens)
    # Inductor fuses and reorders sums: within rounding of eager, not bit for bit.
    args = model.args
    assert_close(loss, ref_loss, terms=llama_terms(args, 16, 32, backward=False), what="loss")
    assert_all_close(grads, ref_grads, terms=llama_terms(args, 16, 32), what="gradient")
    # The checkpoint is part of each block's compiled graph: the recompute happens inside the compiled
    # backward, so each compiled forward runs once (a checkpoint outside the graph would run it twice).
    assert calls["forward"] == 2


def bytes_packed_for_backward(model: Llama, tokens: torch.Tensor) -> int:
    """Bytes of the distinct non-parameter tensors autograd keeps for backward in one forward (works compiled)."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    packed = {}

    def pack(tensor):
        packed[tensor.untyped_storage().data_ptr()] = tensor.untyped_storage().nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        loss = model(tokens).logsumexp(-1).mean()
    del loss
    return sum(n for ptr, n in packed.items() if ptr not in params)


@pytest.mark.slow
def test_every_mode_keeps_its_memory_profile_when_compiled():
    """The checkpoint (with its per-op policy) is traced into each compiled block: compiled, per-op AC still
    keeps the matmul outputs (between full and none), and full AC keeps only block inputs."""
    tokens = torch.randint(0, VOCAB, (4, 64))
    packed = {}
    for mode, option in [("none", None), ("full", None), ("selective", "op")]:
        model = build_tiny(n_layers=2)
        setup_activation_checkpointing(model, ac_mode=mode, ac_option=option)
        compile_blocks_counting_calls(model)
        run_step(model, tokens)  # compile
        packed[mode, option] = bytes_packed_for_backward(model, tokens)
    none, full, op = packed["none", None], packed["full", None], packed["selective", "op"]
    assert full < op < none, packed


class RecordMutations(torch.utils._python_dispatch.TorchDispatchMode):
    """Records in-place mutations of tensors that per-op AC could rely on: the region's inputs and the outputs
    of the ops the policy saves."""

    def __init__(self, inputs):
        super().__init__()
        self.protected = {t.untyped_storage().data_ptr(): "input" for t in inputs}
        self.alive = list(inputs)  # keeps protected storages allocated, so their addresses are not reused
        self.bad = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        schema = func._schema
        for i, arg in enumerate(schema.arguments):
            if arg.alias_info is not None and arg.alias_info.is_write:
                value = args[i] if i < len(args) else kwargs.get(arg.name)
                if isinstance(value, torch.Tensor):
                    owner = self.protected.get(value.untyped_storage().data_ptr())
                    if owner is not None:
                        self.bad.append(f"{func} mutates {owner}")
        out = func(*args, **kwargs)
        if func in SAVED_OPS:
            for t in out if isinstance(out, (tuple, list)) else [out]:
                if isinstance(t, torch.Tensor):
                    self.protected[t.untyped_storage().data_ptr()] = f"the saved output of {func}"
                    self.alive.append(t)
        return out


@pytest.mark.parametrize("dropout", [0.0, 0.1])
@pytest.mark.parametrize("document_ids", [False, True])
def test_transformer_block_mutates_nothing_per_op_ac_saves(dropout, document_ids):
    """The premise of silence_compiled_policy_warning: the built-in block never writes in place to its inputs
    or to a matmul/attention output (dropout fills fresh mask tensors in place, which is harmless)."""
    model = build_tiny(n_layers=1, dropout=dropout)
    model.train()
    tokens = torch.randint(0, VOCAB, (2, 16))
    x = model.tok_embeddings(tokens).detach().requires_grad_()
    if document_ids:
        ids = torch.tensor([[0] * 8 + [1] * 8] * 2)
        positions, runs = positions_from_document_ids(ids), document_runs(ids)
    else:
        positions, runs = torch.arange(16).expand(2, 16), None
    cos, sin = model.rope_cos_sin(positions, x.dtype)
    inputs = [x, cos, sin] + ([runs.cu_seqlens] if runs is not None else [])
    with RecordMutations(inputs) as recorder:
        model.layers[0](x, cos, sin, runs)
    assert recorder.bad == []
    # The recorder does catch such writes, so the empty list above means something.
    with RecordMutations([x]) as recorder:
        y = torch.mm(x[0], model.layers[0].attn.q_proj.weight.t())
        y.relu_()
        x.detach().mul_(1)
    assert recorder.bad == ["aten.relu_.default mutates the saved output of aten.mm.default", "aten.mul_.Tensor mutates input"]


@pytest.mark.slow
def test_compiled_blocks_replay_dropout_in_every_mode():
    """Compiled, with dropout, every AC mode gives the loss and gradients of compiled training without AC:
    the recompute inside each compiled block reuses the forward's dropout masks.

    Not bit for bit: inductor fuses a checkpointed graph differently from a plain one, so sums may be
    reassociated (seen: 7.5e-9 on the embedding gradient); compared within rounding (``numerics``). A replay
    with other masks is off by orders of magnitude more than that, which the last assertion shows."""
    torch.manual_seed(0)
    tokens = torch.randint(0, VOCAB, (2, 17))
    results = {}
    for mode, option in [("none", None), ("full", None), ("selective", "op"), ("selective", 2)]:
        torch._dynamo.reset()
        model = build_tiny(n_layers=2, dropout=0.3)
        setup_activation_checkpointing(model, ac_mode=mode, ac_option=option)
        for block in model.layers:
            block.compile()
        results[mode, option] = run_step(model, tokens)
    ref_loss, ref_grads = results["none", None]
    args = build_tiny(n_layers=2).args

    def assert_same(loss, grads, key):
        assert_close(loss, ref_loss, terms=llama_terms(args, 16, 32, backward=False), what=f"{key} loss")
        assert_all_close(grads, ref_grads, terms=llama_terms(args, 16, 32), what=f"{key} gradient")

    for key, (loss, grads) in results.items():
        assert_same(loss, grads, key)
    # The same model with other dropout masks (another seed) fails that comparison.
    model = build_tiny(n_layers=2, dropout=0.3)
    torch.manual_seed(99)
    loss = F.cross_entropy(model(tokens[:, :-1]).reshape(-1, VOCAB), tokens[:, 1:].reshape(-1))
    loss.backward()
    with pytest.raises(AssertionError):
        assert_same(loss.detach(), {n: p.grad for n, p in model.named_parameters()}, "other masks")


def test_compiled_policy_warning_filter_drops_only_that_warning(caplog):
    logger = logging.getLogger("torch._higher_order_ops.wrap")
    before = list(logger.filters)
    try:
        silence_compiled_policy_warning()
        silence_compiled_policy_warning()
        assert len(logger.filters) == len(before) + 1
        with caplog.at_level(logging.WARNING, logger=logger.name):
            logger.warning("\nDetected that context_fn is passed to torch.utils.checkpoint under torch.compile.\n")
            logger.warning("something else")
        assert [r.getMessage() for r in caplog.records] == ["something else"]
    finally:
        logger.filters[:] = before
