"""TRL's ``DPOTrainer`` over the pairs of ``bench_dpo.py --only speed``, in a process of its own (its peak resident
set is its own): one side of that comparison.

    python scripts/bench/_dpo_trl_worker.py SETTINGS_JSON

``SETTINGS_JSON`` names the HF checkpoint (written with ``save_hf``, the same weights ``tune run`` starts from), the
pairs already tokenized (``prompt_ids``/``chosen_ids``/``rejected_ids`` per line: the token ids our
``preference_dataset`` made, BOS, EOS and truncation included), the tokenizer, the batch, ``max_length``, the
learning rate, the weight decay and the threads.

Set so that TRL does the same work a step as ``full_dpo``: the same token ids (its own tokenization, which
tokenizes prompt and answer together and adds no BOS with this tokenizer, is skipped: ``_prepare_dataset`` returns
the tokenized pairs as they are); the pairs in order (``train_sampling_strategy: sequential``, the last partial
batch dropped, as ``shuffle: false`` does); a resident reference model (``ref_model`` given, its forward every step,
as ``dpo.reference: resident``); ``torch.optim.AdamW`` (``optim: adamw_torch``, not TRL's fused default); no
gradient checkpointing, evaluation, logging or saving during training.

Prints one JSON line: each optimizer step's seconds (``on_step_begin`` to ``on_step_end``: the batch is fetched and
collated before), each step's answer tokens (the collated ``completion_mask``'s sum, to check that its steps held
the pairs ours did) and the process's peak resident set in GiB.
"""

from __future__ import annotations

import json
import resource
import sys
import time


def main() -> int:
    settings = json.loads(sys.argv[1])
    import torch

    torch.set_num_threads(settings["threads"])
    import datasets
    import trl
    from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast, TrainerCallback

    datasets.disable_progress_bars()
    records = [json.loads(line) for line in open(settings["pairs"])]
    step_seconds: list[float] = []
    step_answer_tokens: list[int] = []

    class StepClock(TrainerCallback):
        def on_step_begin(self, args, state, control, **kwargs):
            self.started = time.perf_counter()

        def on_step_end(self, args, state, control, **kwargs):
            step_seconds.append(time.perf_counter() - self.started)

    class PretokenizedDPOTrainer(trl.DPOTrainer):
        def _prepare_dataset(self, dataset, processing_class, args, dataset_name):
            return dataset  # already TRL's tokenized columns, from our tokenizer and truncation

    config = trl.DPOConfig(
        output_dir=settings["output_dir"], per_device_train_batch_size=settings["batch_size"],
        max_length=settings["max_length"], learning_rate=settings["lr"], weight_decay=settings["weight_decay"],
        optim="adamw_torch", max_grad_norm=1.0, num_train_epochs=1, beta=0.1, train_sampling_strategy="sequential",
        dataloader_drop_last=True, logging_steps=10**9, save_strategy="no", eval_strategy="no", report_to=[],
        use_cpu=True, bf16=False, fp16=False, gradient_checkpointing=False, precompute_ref_log_probs=False,
        dataloader_num_workers=0, seed=0)
    trainer = PretokenizedDPOTrainer(
        model=AutoModelForCausalLM.from_pretrained(settings["checkpoint"], attn_implementation="sdpa"),
        ref_model=AutoModelForCausalLM.from_pretrained(settings["checkpoint"], attn_implementation="sdpa"),
        args=config, train_dataset=datasets.Dataset.from_list(records),
        processing_class=PreTrainedTokenizerFast.from_pretrained(settings["tokenizer"]), callbacks=[StepClock()])
    collate = trainer.data_collator

    def counting_collator(examples):
        batch = collate(examples)
        step_answer_tokens.append(int(batch["completion_mask"].sum()))
        return batch

    trainer.data_collator = counting_collator
    trainer.train()
    peak_gib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 2**30  # Linux: KiB
    print(json.dumps({"step_seconds": step_seconds, "step_answer_tokens": step_answer_tokens, "peak_gib": peak_gib}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
