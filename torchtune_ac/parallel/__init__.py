"""The mechanisms that split a model over the run's processes, each one module applied in ``run/assemble.py``'s
order: tensor parallelism (``tensor_parallel.py``) and FSDP2 (``fsdp.py``). How the processes split the work (the
``Parallelism`` value, its checks and its device mesh) is ``runtime/parallelism.py``'s."""
