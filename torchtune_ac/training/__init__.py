"""Training: the step (``step.py``: who steps the parameters, the objective each micro-batch's loss comes from),
the objectives (``objective.py``, DPO's ``dpo.py``), evaluation and the LR schedules.

The names below are the package's public ones: the LR schedules configs name as components
(``_component_: torchtune_ac.training.cosine_schedule_with_warmup``), and ``setup_activation_checkpointing``,
whose home is ``torchtune_ac.activation_checkpointing``: it stays importable from here, where scripts written for
earlier releases import it.
"""

from torchtune_ac.activation_checkpointing import setup_activation_checkpointing
from torchtune_ac.training.lr_schedulers import constant_schedule, cosine_schedule_with_warmup

__all__ = ["constant_schedule", "cosine_schedule_with_warmup", "setup_activation_checkpointing"]
