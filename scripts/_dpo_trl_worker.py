"""TRL's ``DPOTrainer`` over the pairs of ``bench_dpo.py --only speed``, in a process of its own (its peak resident
set is its own): one side of that comparison.

    python scripts/_dpo_trl_worker.py SETTINGS_JSON

``SETTINGS_JSON`` names the HF checkpoint (written with ``save_hf``, the same weights ``tune run`` starts from), the
pairs (``prompt``/``chosen``/``rejected`` strings), the tokenizer, the batch, ``max_length``, the learning rate and
the threads. Prints one JSON line: each optimizer step's seconds (``on_step_begin`` to ``on_step_end``) and the
process's peak resident set in GiB.
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

    class StepClock(TrainerCallback):
        def on_step_begin(self, args, state, control, **kwargs):
            self.started = time.perf_counter()

        def on_step_end(self, args, state, control, **kwargs):
            step_seconds.append(time.perf_counter() - self.started)

    config = trl.DPOConfig(
        output_dir=settings["output_dir"], per_device_train_batch_size=settings["batch_size"],
        max_length=settings["max_length"], learning_rate=settings["lr"], num_train_epochs=1, beta=0.1,
        logging_steps=10**9, save_strategy="no", report_to=[], use_cpu=True, bf16=False, fp16=False,
        dataloader_num_workers=0, seed=0)
    trainer = trl.DPOTrainer(
        model=AutoModelForCausalLM.from_pretrained(settings["checkpoint"], attn_implementation="sdpa"),
        ref_model=AutoModelForCausalLM.from_pretrained(settings["checkpoint"], attn_implementation="sdpa"),
        args=config, train_dataset=datasets.Dataset.from_list(records),
        processing_class=PreTrainedTokenizerFast.from_pretrained(settings["tokenizer"]), callbacks=[StepClock()])
    trainer.train()
    peak_gib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 2**30  # Linux: KiB
    print(json.dumps({"step_seconds": step_seconds, "peak_gib": peak_gib}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
