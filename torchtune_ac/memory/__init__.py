"""What a training step keeps in memory, and the features (the user's "memory switches") that decide it: each in
one module with its resolution, planner cost and mechanism (the optimizer state, the optimizer step in backward, the
chunked loss, activation offloading, CPU offload; activation checkpointing's is its own package), listed once in
``features.py``; the memory plan that resolves them together (``plan.py``), and the planner that estimates a step's
memory before anything runs (``planner/``: what it estimates, one simulated step, a plan's estimate, the search)."""
