"""What a training step keeps in memory, and the switches that decide it: activation checkpointing, the
optimizer step in backward and the chunked loss (each declared once, see ``switch.py``), the memory plan that
resolves them together (``plan.py``), and the planner that estimates a step's memory before anything runs
(``planner.py``)."""
