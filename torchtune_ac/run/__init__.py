"""The run layer: the phases of setting up and running a fine-tuning job, as library functions that return typed
values (the run context, the resume choice, the model and its stepper, the data, the save policy), and the
messages a user sees when a run stops or resumes. A recipe composes them (``recipes/full_finetune.py``)."""
