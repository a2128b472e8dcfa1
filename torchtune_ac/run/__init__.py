"""The run layer: resolve the run once, apply it in one written order, loop.

    session.py    the process context, created once; stop signals; output_dir's lock; cleanup     (open_run)
    plan.py       the run's plan, one frozen value, resolved by rank 0 and applied by every rank   (RunPlan)
                  with its parallelism, every degree checked once                                   (resolve_parallelism)
    checks.py     the plan against this machine and the files                                      (check_run)
    setup.py      the set-up every recipe shares: a recipe names its batching and its objective    (run_recipe)
    assemble.py   the run's one device mesh, and the one order that applies the plan:             (build_training)
                      1. adapters  2. activation checkpointing  3. activation offloading  4. compile
                      5. tensor parallelism  6. expert parallelism  7. FSDP2  8. materialise  9. load or initialise
                      10. optimizer  11. stepper  12. scheduler
    weights.py    the initial weights without a checkpoint, the same for any sharding
    phases.py     the data, validation data, resume choice and restore
    reference.py  DPO's precomputed reference: one pass over the pairs the run reads, then freed (precompute_reference)
    loop.py       the loop every recipe shares: steps, logging, validation, saving, stop signals  (TrainingLoop)
    preflight.py  what tune validate, tune plan and the launcher ask of a recipe
    memory_table.py  tune plan's table
    messages.py   what a user reads when a run stops or resumes
"""
