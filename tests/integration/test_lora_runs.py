"""``tune run lora_finetune`` and ``lora_dpo`` on the embedded model: a checkpoint holds the adapters (PEFT's
folder) and their optimizer state, not the base; a resume is exact; 2 processes (FSDP2) train like 1, and one
process resumes their checkpoint; HSDP (2 x 2) resumes one process's checkpoint and trains like it; PEFT loads a
run's folder, which is also a starting point; packed rows start at the base; bad adapter input is refused in one
line, exit 2, nothing written."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from finetune_runs import check_success, final_checkpoint, hash_tree, run_tune_in_process, run_tune_subprocess
from numerics import assert_close, assert_steps_alike, assert_weights_trained_alike, llama_terms
from safetensors.torch import load_file, save_file
from torch.distributed.checkpoint import FileSystemReader

from torchtune_ac.checkpoint import RECIPE_STATE_DIR
from torchtune_ac.checkpoint.peft import ADAPTER_CONFIG_FILE, ADAPTER_WEIGHTS_FILE
from torchtune_ac.lora.config import AdapterConfig, AdapterKind
from torchtune_ac.lora.mechanism import apply_adapters
from torchtune_ac.lora.weights import load_or_initialize_adapters_
from torchtune_ac.models import load_hf
from torchtune_ac.models.families.llama import LLAMA_TINY
from torchtune_ac.observability.metrics import read_metrics

STEPS = 4
# DoRA on every linear of the blocks: the magnitude's rows are sharded like the base's under FSDP2.
RUN = ("max_seq_len=64", f"max_steps_per_epoch={STEPS}", "save_every_n_steps=2", "lr_scheduler.num_warmup_steps=1",
       "adapter.kind=dora")
TERMS = llama_terms(LLAMA_TINY, 64, 4 * 64)


def argv(output_dir: Path, *overrides: str, nproc: int = 1, recipe: str = "lora_finetune",
         config: str = "tiny/lora") -> list[str]:
    launcher = ["--nproc_per_node", str(nproc)] if nproc > 1 else []
    return ["run", *launcher, recipe, "--config", config, *RUN, f"output_dir={output_dir}", *overrides]


def run(output_dir: Path, *overrides: str, nproc: int = 1, batch_size: int = 4) -> list[dict]:
    command = argv(output_dir, f"batch_size={batch_size}", *overrides, nproc=nproc)
    check_success(run_tune_subprocess(command) if nproc > 1 else run_tune_in_process(command))
    return read_metrics(output_dir)


def adapters(checkpoint: Path) -> dict[str, torch.Tensor]:
    return load_file(checkpoint / ADAPTER_WEIGHTS_FILE)


def resume_from_step_2(source: Path, target: Path, *, nproc: int = 1, batch_size: int = 4) -> list[dict]:
    """``source``'s run as if killed after its step-2 checkpoint, resumed into ``target``."""
    shutil.copytree(source, target, symlinks=True)
    shutil.rmtree(target / "step_0000004")
    return run(target, "resume_from_checkpoint=true", nproc=nproc, batch_size=batch_size)


@pytest.fixture(scope="module")
def one_process(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[dict]]:
    output_dir = tmp_path_factory.mktemp("lora") / "one"
    return output_dir, run(output_dir)


def test_a_checkpoint_holds_the_adapters_and_their_state_not_the_base(one_process):
    output_dir, records = one_process
    checkpoint = final_checkpoint(output_dir)
    assert (checkpoint / ADAPTER_CONFIG_FILE).is_file() and not (checkpoint / "model.safetensors").exists()
    names = list(adapters(checkpoint))
    assert len(names) == 3 * 7 * LLAMA_TINY.n_layers  # A, B and DoRA's magnitude on 7 linears a block
    assert all(name.startswith("base_model.model.model.layers.") for name in names)
    saved = FileSystemReader(str(checkpoint / RECIPE_STATE_DIR)).read_metadata().state_dict_metadata
    model_keys = [key for key in saved if key.startswith("model.")]
    assert model_keys and all(".lora_" in key for key in model_keys), model_keys[:3]
    assert records[-1]["loss"] < records[0]["loss"]


def test_resume_is_exact(one_process, tmp_path):
    output_dir, records = one_process
    resumed = resume_from_step_2(output_dir, tmp_path / "resumed")
    # Bit for bit: one process, the same ops in the same order, the adapters, Adam's state and the RNG restored.
    assert [r["loss"] for r in resumed[-2:]] == [r["loss"] for r in records[-2:]]
    expected, actual = adapters(final_checkpoint(output_dir)), adapters(final_checkpoint(tmp_path / "resumed"))
    assert all(torch.equal(actual[name], tensor) for name, tensor in expected.items())


@pytest.mark.numerics
@pytest.mark.distributed
def test_two_processes_train_like_one_and_one_resumes_them(one_process, tmp_path, embedded_checkpoint):
    output_dir, records = one_process
    two = run(tmp_path / "two", "adapter.save_merged=true", nproc=2, batch_size=2)
    for name in ("loss", "grad_norm"):
        assert_steps_alike([r[name] for r in two], [r[name] for r in records], terms=TERMS, what=name)
    lrs = [r["lr"] for r in records]
    assert_weights_trained_alike(adapters(final_checkpoint(tmp_path / "two")), adapters(final_checkpoint(output_dir)),
                                 lrs=lrs, terms=TERMS)
    # 2 -> 1: the sharded adapters and their Adam state, resharded by DCP, continue on one process.
    resumed = resume_from_step_2(tmp_path / "two", tmp_path / "resumed")
    assert_steps_alike([r["loss"] for r in resumed], [r["loss"] for r in two], terms=TERMS, what="resumed loss")
    assert_weights_trained_alike(adapters(final_checkpoint(tmp_path / "resumed")),
                                 adapters(final_checkpoint(tmp_path / "two")), lrs=lrs, terms=TERMS)
    # The merged model, each rank merging its own rows, is in merged/, apart from the adapters (transformers, with
    # peft installed, would apply adapters beside it once more): loaded alone, it gives PEFT's base + adapters.
    peft = pytest.importorskip("peft")
    from transformers import AutoModelForCausalLM

    folder = final_checkpoint(tmp_path / "two")
    assert not (folder / "config.json").exists() and (folder / "merged" / "tokenizer.json").is_file()
    tokens = torch.randint(0, 512, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        base = AutoModelForCausalLM.from_pretrained(embedded_checkpoint).eval()(input_ids=tokens).logits
        expected = peft.PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(embedded_checkpoint),
                                                  folder).eval()(input_ids=tokens).logits
        logits = AutoModelForCausalLM.from_pretrained(folder / "merged").eval()(input_ids=tokens).logits
    assert not torch.equal(logits, base)  # the adapters trained: the merged model is not the base
    assert_close(logits, expected, terms=llama_terms(LLAMA_TINY, 16, 0, backward=False), what="merged logits")


@pytest.mark.slow
@pytest.mark.distributed
def test_hsdp_2x2_resumes_one_process_s_checkpoint_and_trains_like_it(one_process, tmp_path):
    """HSDP over base and adapters (2 replicas x 2 shards, 4 processes, each a quarter of the global batch) continues
    the one process run's step-2 checkpoint (1 -> 4, resharded by DCP): its steps 3 and 4 and the adapters after
    them are the one process run's within rounding (gloo adds in another order)."""
    output_dir, records = one_process
    hsdp_dir = tmp_path / "hsdp"
    shutil.copytree(output_dir, hsdp_dir, symlinks=True)
    shutil.rmtree(hsdp_dir / "step_0000004")
    result = run_tune_subprocess(argv(hsdp_dir, "batch_size=1", "fsdp.replicate_degree=2",
                                      "resume_from_checkpoint=true", nproc=4))
    check_success(result)
    assert "HSDP: 2 replicas x 2 shards" in result.stderr and "resharded from 1 process(es) to 4" in result.stderr
    hsdp = read_metrics(hsdp_dir)
    assert [r["step"] for r in hsdp] == list(range(1, STEPS + 1))
    for name in ("loss", "grad_norm"):
        assert_steps_alike([r[name] for r in hsdp[2:]], [r[name] for r in records[2:]], terms=TERMS, what=name)
    assert_weights_trained_alike(adapters(final_checkpoint(hsdp_dir)), adapters(final_checkpoint(output_dir)),
                                 lrs=[r["lr"] for r in records], terms=TERMS)


@pytest.mark.numerics
def test_peft_loads_a_runs_folder_which_is_also_a_starting_point(one_process, embedded_checkpoint):
    peft = pytest.importorskip("peft")
    from transformers import AutoModelForCausalLM

    folder = final_checkpoint(one_process[0])
    tokens = torch.randint(0, 512, (2, 16), generator=torch.Generator().manual_seed(0))
    ours = load_hf(embedded_checkpoint)
    config = AdapterConfig(kind=AdapterKind.DORA, targets=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj",
                                                           "up_proj", "down_proj"], checkpoint_dir=str(folder))
    apply_adapters(ours, config)
    load_or_initialize_adapters_(ours, config, seed=0)
    with torch.no_grad():
        theirs = peft.PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(embedded_checkpoint), folder)
        expected = theirs.eval()(input_ids=tokens).logits
        assert_close(ours.eval()(tokens), expected, terms=llama_terms(LLAMA_TINY, 16, 0, backward=False),
                     what="logits")


def test_the_chunked_loss_and_the_step_in_backward_train_the_adapters_as_the_plain_step(tmp_path):
    """``loss_chunks=4`` (the logits never whole) with ``optimizer_in_bwd`` (each adapter stepped in backward, its
    gradient freed) against the plain step, no clipping in both: the same run within rounding (the chunks add the
    loss in another order), and only the adapters have optimizer state."""
    plain = run(tmp_path / "plain", "clip_grad_norm=null", "save_every_n_steps=null")
    fused = run(tmp_path / "fused", "clip_grad_norm=null", "save_every_n_steps=null", "loss_chunks=4",
                "optimizer_in_bwd=true")
    assert_steps_alike([r["loss"] for r in fused], [r["loss"] for r in plain], terms=TERMS, what="loss")
    assert_weights_trained_alike(adapters(final_checkpoint(tmp_path / "fused")),
                                 adapters(final_checkpoint(tmp_path / "plain")), lrs=[r["lr"] for r in plain],
                                 terms=TERMS)
    saved = FileSystemReader(str(final_checkpoint(tmp_path / "fused") / RECIPE_STATE_DIR)).read_metadata()
    state = [key for key in saved.state_dict_metadata if key.startswith("optimizer.state.")]
    assert state and all(".lora_" in key for key in state), state[:3]


def test_packed_rows_start_at_the_base_and_train_the_adapters(tmp_path):
    """``dataset.packed: true`` with adapters: step 1 is the packed full fine-tuning run's own loss bit for bit (B is
    zero, the same packed rows and per-document attention), every row is packed, and only the adapters train."""
    packed = ("dataset.packed=true", "max_seq_len=128", "batch_size=4", "clip_grad_norm=null")
    check_success(run_tune_in_process(["run", "full_finetune", "--config", "tiny/full", *packed,
                                       "max_steps_per_epoch=1", f"output_dir={tmp_path / 'full'}"]))
    check_success(run_tune_in_process(["run", "lora_finetune", "--config", "tiny/lora", *packed,
                                       "max_steps_per_epoch=3", f"output_dir={tmp_path / 'lora'}"]))
    full, lora = read_metrics(tmp_path / "full"), read_metrics(tmp_path / "lora")
    assert lora[0]["loss"] == full[0]["loss"] and lora[0]["target_tokens"] == full[0]["target_tokens"]
    assert all(r["tokens"] == 4 * 128 for r in lora)  # every row packed to max_seq_len
    assert lora[-1]["loss"] < lora[0]["loss"]
    trained = adapters(final_checkpoint(tmp_path / "lora"))
    assert all(t.abs().max() > 0 for name, t in trained.items() if "lora_B" in name)


def test_lora_dpo_starts_at_the_base(tmp_path):
    """The reference is the policy's base with the adapters off: at step 1 (B zero) every reward is exactly 0."""
    command = ["run", "lora_dpo", "--config", "tiny/lora_dpo", "max_seq_len=64", "batch_size=4",
               "max_steps_per_epoch=2", "run_val_every_n_steps=null", "dataset_val=null",
               f"output_dir={tmp_path / 'dpo'}"]
    check_success(run_tune_in_process(command))
    records = read_metrics(tmp_path / "dpo")
    assert records[0]["rewards_chosen"] == 0.0 and records[0]["rewards_rejected"] == 0.0
    assert records[1]["rewards_margin"] != 0.0
    assert (final_checkpoint(tmp_path / "dpo") / ADAPTER_WEIGHTS_FILE).is_file()


def test_lora_dpo_s_precomputed_reference_trains_as_its_resident_one(tmp_path):
    """``dpo.reference: precomputed``: the base built alone, run once before training, then freed; its
    log-probabilities came from other batches (other padding) than the resident path's adapters-off forward, so
    the runs are the same within rounding."""
    def dpo(name: str, *overrides: str) -> list[dict]:
        command = ["run", "lora_dpo", "--config", "tiny/lora_dpo", "max_seq_len=64", "batch_size=4",
                   f"max_steps_per_epoch={STEPS}", "run_val_every_n_steps=null", "dataset_val=null",
                   f"output_dir={tmp_path / name}", *overrides]
        check_success(run_tune_in_process(command))
        return read_metrics(tmp_path / name)

    resident, precomputed = dpo("resident"), dpo("precomputed", "dpo.reference=precomputed")
    terms = llama_terms(LLAMA_TINY, 64, 8 * 64)
    for name in ("loss", "grad_norm", "rewards_margin"):
        assert_steps_alike([r[name] for r in precomputed], [r[name] for r in resident], terms=terms, what=name)
    assert_weights_trained_alike(adapters(final_checkpoint(tmp_path / "precomputed")),
                                 adapters(final_checkpoint(tmp_path / "resident")),
                                 lrs=[r["lr"] for r in resident], terms=terms)


REFUSED = {
    "rank_0": (["adapter.rank=0"], "adapter.rank=0: must be >= 1"),
    "rank_negative": (["adapter.rank=-8"], "adapter.rank=-8: must be >= 1"),
    "alpha_0": (["adapter.alpha=0"], "adapter.alpha=0.0: must be > 0.0"),
    "unknown_kind": (["adapter.kind=vera"], "adapter.kind='vera': expected one of lora, dora"),
    "unknown_quantisation": (["adapter.quantize_base=int4"], "adapter.quantize_base='int4': expected one of nf4"),
    "target_matching_nothing": (["adapter.targets=[q_proj,qkv]"],
                                "adapter.targets: qkv match(es) no linear of this model; its linears are down_proj"),
    "nf4_cannot_quantise": (["adapter.quantize_base=nf4", "adapter.targets=[k_proj]"],
                            "adapter.quantize_base=nf4: layers.0.attn.k_proj.weight (64, 128) has 8192 weights"),
    "folder_of_another_rank": (["adapter.rank=4", "adapter.checkpoint_dir={folder}"], "its r is 8, this run's"),
    "folder_of_other_targets": (["adapter.targets=[q_proj,v_proj]", "adapter.checkpoint_dir={folder}"],
                                "not an adapter of this base with these targets"),
    "folder_of_another_base": (["adapter.checkpoint_dir={other_base}"],
                               "lora_A.weight is [8, 256], this model's is [8, 128]: an adapter of another base"),
    "folder_of_another_base_s_names": (["adapter.checkpoint_dir={other_names}"],
                                       "base_model.model.transformer.h.0.mlp.down_proj.lora_A.weight is not an "
                                       "adapter of this model"),
}


def adapter_of_a_wider_base(folder: Path, target: Path) -> Path:
    """``folder``'s PEFT adapter with the same names, as trained on a base of twice the hidden size (A [r, 2 in])."""
    target.mkdir()
    shutil.copy(folder / ADAPTER_CONFIG_FILE, target)
    save_file({name: torch.cat([t, t], dim=-1) if "lora_A" in name else t for name, t in adapters(folder).items()},
              target / ADAPTER_WEIGHTS_FILE)
    return target


def adapter_of_another_base_s_names(folder: Path, target: Path) -> Path:
    """``folder``'s PEFT adapter with the same shapes under another model's names (GPT-2's ``transformer.h.N``)."""
    target.mkdir()
    shutil.copy(folder / ADAPTER_CONFIG_FILE, target)
    save_file({name.replace(".model.layers.", ".transformer.h."): t for name, t in adapters(folder).items()},
              target / ADAPTER_WEIGHTS_FILE)
    return target


@pytest.mark.parametrize("name", sorted(REFUSED))
def test_bad_adapter_input_exits_2_with_one_line_and_writes_nothing(name, tmp_path, one_process):
    overrides, message = REFUSED[name]
    folder = final_checkpoint(one_process[0])
    other_base = adapter_of_a_wider_base(folder, tmp_path / "other_base")
    other_names = adapter_of_another_base_s_names(folder, tmp_path / "other_names")
    before = hash_tree(tmp_path)
    result = run_tune_in_process(argv(tmp_path / "out", *(o.format(folder=folder, other_base=other_base,
                                                                   other_names=other_names) for o in overrides)))
    assert result.returncode == 2, result.stderr
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert message in lines[-1] and "Traceback" not in result.stderr, result.stderr
    assert hash_tree(tmp_path) == before


@pytest.mark.parametrize("config, overrides, nproc, message", [
    ("tiny/lora", ("tensor_parallel_dim=2",), 2,
     "tensor_parallel_dim=2: adapters (the adapter: section) do not run under tensor parallelism"),
    ("tiny/lora", ("expert_parallel_dim=2",), 2,
     "expert_parallel_dim=2: adapters (the adapter: section) do not run under expert parallelism"),
    ("tiny/qlora", ("fsdp.replicate_degree=2",), 4,
     "adapter.quantize_base=nf4: the NF4 base is sharded by FSDP2 over one dimension of processes, not under HSDP"),
])
def test_a_parallel_layout_the_adapters_do_not_run_under_is_refused_by_tune_plan(config, overrides, nproc, message):
    """From the config alone (the launcher checks the same before starting processes): ``tune plan`` plans no
    layout the run refuses."""
    result = run_tune_in_process(["plan", "--config", config, "--nproc", str(nproc), *overrides])
    assert result.returncode == 2
    (line,) = result.stderr.strip().splitlines()
    assert line.startswith(f"tune: error: {message}"), line
