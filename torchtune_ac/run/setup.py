"""The set-up every recipe shares, in one function: ``setup_training``.

    the tokenizer -> one meta build of the model -> the plan (rank 0's, checked) -> the data and its steps
    -> validation data -> the run's device mesh -> the recipe's objective (its own parts: DPO's reference)
    -> the model assembled (``assemble.py``) -> resume or not -> the disk checked -> the loop (``loop.py``)

A recipe names what is its own and nothing else: its kind of data (``Batching``: samples, or preference pairs) and
its objective (``make_objective``; None: the memory plan's token loss), made before the model it trains is
assembled, from the parts the set-up has made so far (``SetupParts``).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from tqdm.contrib.logging import logging_redirect_tqdm

from torchtune_ac.config.meta_model import build_meta_model
from torchtune_ac.models.vision.checks import check_model_takes_images
from torchtune_ac.run import messages
from torchtune_ac.run.assemble import build_mesh, build_training
from torchtune_ac.run.loop import TrainingLoop
from torchtune_ac.data.batching import SAMPLES, Batching
from torchtune_ac.run.phases import (
    RunData,
    ValidationData,
    build_data,
    build_validation,
    check_disk_space,
    choose_resume,
    estimate_checkpoint_size,
    restore,
)
from torchtune_ac.run.plan import RunPlan, RunConfig
from torchtune_ac.run.session import Run, log_plan, open_run, plan_run
from torchtune_ac.training.objective import Objective

log = logging.getLogger("torchtune_ac.run")


@dataclass(frozen=True)
class SetupParts:
    """What the set-up has made when a recipe's objective is asked for.

    Attributes:
        run: this process's run (its config and context: ``run.ctx`` has the plan's parallelism).
        plan: the run's plan, its steps counted.
        model: the meta build of the model, not yet assembled (a recipe copies it for a second model of the same
            architecture: DPO's reference).
        tokenizer: the run's tokenizer.
        data: this rank's training data.
        validation: the held-out data, or None.
        mesh: the run's device mesh (None when the model is not sharded): every model of the run is sharded over it.
    """

    run: Run
    plan: RunPlan
    model: nn.Module
    tokenizer: Any
    data: RunData
    validation: Optional[ValidationData]
    mesh: Optional[DeviceMesh]


MakeObjective = Callable[[SetupParts], Objective]
# A recipe's own loop (GRPO's, whose step is a rollout), called as ``TrainingLoop`` is.
MakeLoop = Callable[..., TrainingLoop]


def setup_training(run: Run, *, batching: Batching = SAMPLES,
                   make_objective: Optional[MakeObjective] = None,
                   make_loop: MakeLoop = TrainingLoop) -> TrainingLoop:
    """Set up ``run`` in the one order (see the module docstring), up to the loop, ready to train.

    Args:
        run: this process's run (``open_run``).
        batching: how the recipe's samples become batches.
        make_objective: the recipe's objective, made from the parts set up so far, before the model it trains is
            assembled; None: the memory plan's (the next-token loss, chunked or whole).
        make_loop: the loop (``TrainingLoop``, or a recipe's own made the same way: GRPO's).

    Raises:
        UserError: on every rank, what the plan, the data or the checkpoint refused.
    """
    cfg, ctx = run.cfg, run.ctx
    tokenizer = cfg.tokenizer.instantiate()  # this process's one tokenizer
    model = build_meta_model(cfg.model, cfg.checkpoint_dir)  # ...and its one meta build of the model
    plan = plan_run(run, model, tokenizer=tokenizer)  # rank 0's, checked, before anything heavy
    ctx = run.ctx  # now with the plan's parallelism: which share of the data this rank reads
    data = build_data(cfg, tokenizer, ctx, batching=batching)
    if len(data.loader.dataset):  # images the model cannot take are refused before any weight loads
        check_model_takes_images(model, data.loader.dataset[0], "dataset")
    plan = plan.with_data(data.samples, len(data.loader), described=data.described, unit=data.unit)
    log_plan(run, plan)
    validation = build_validation(cfg, tokenizer, ctx, batching=batching)
    mesh = build_mesh(plan, ctx)
    objective = (make_objective(SetupParts(run, plan, model, tokenizer, data, validation, mesh))
                 if make_objective is not None else None)
    resume_from = choose_resume(cfg, ctx).checkpoint
    training = build_training(
        model, plan, ctx=ctx, mesh=mesh, objective=objective,
        # A resume loads its own; with adapters, only those: the frozen base is read from checkpoint_dir again.
        load_weights=resume_from is None or plan.adapter is not None,
        make_optimizer=cfg.optimizer.instantiate,
        make_scheduler=None if cfg.lr_scheduler is None else (
            lambda optimizer: cfg.lr_scheduler.instantiate(optimizer, num_training_steps=plan.length.optimizer_steps)),
    )
    if resume_from is not None:
        run.progress = restore(plan, ctx, resume_from, training, data)
        run.last_checkpoint = resume_from
    elif cfg.resume_from_checkpoint:
        log.info(messages.no_checkpoint_yet(cfg.output_dir))
    tokenizer_dir = Path(tokenizer.path).parent  # its files go into every checkpoint
    check_disk_space(plan, ctx, estimate_checkpoint_size(cfg, training.model, tokenizer_dir),
                     plan.save.saves(run.progress.step, plan.length))
    trainer = make_loop(run, plan, training, data, tokenizer=tokenizer, validation=validation)
    trainer.open_metrics()
    return trainer


def run_recipe(cfg: RunConfig, *, batching: Batching = SAMPLES,
               make_objective: Optional[MakeObjective] = None, make_loop: MakeLoop = TrainingLoop) -> None:
    """Run a recipe from its config: open the run, set it up (``setup_training``), train; cleanup always runs
    (after a success, every rank shuts down together)."""
    with open_run(cfg) as run:
        trainer = setup_training(run, batching=batching, make_objective=make_objective, make_loop=make_loop)
        with logging_redirect_tqdm():
            trainer.train()
