"""The run layer: resolve the run once, apply it in one written order, loop.

    session.py    the process context, created once; stop signals; output_dir's lock; cleanup     (open_run)
    plan.py       the run's plan, one frozen value, resolved by rank 0 and applied by every rank   (RunPlan)
    checks.py     the plan against this machine and the files                                      (check_run)
    assemble.py   the one order: AC -> offloading -> compile -> FSDP2 -> materialise -> load; optimizer,
                  stepper, scheduler                                                              (build_training)
    phases.py     the data, validation data, resume choice and restore
    reference.py  DPO's precomputed reference: one pass over the pairs the run reads, then freed (precompute_reference)
    loop.py       the loop every recipe shares: steps, logging, validation, saving, stop signals  (Trainer)
    preflight.py  what tune validate, tune plan and the launcher ask of a recipe
    memory_table.py  tune plan's table
    messages.py   what a user reads when a run stops or resumes

A recipe composes them with what is its own: its data and its step (``recipes/full_finetune.py``).
"""
