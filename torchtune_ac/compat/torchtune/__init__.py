"""What exists only for torchtune's users: ``tune migrate`` (``migrate.py``: torchtune configs to ours) and the
component paths that mirror torchtune's (``paths.py``). The AC keys (``enable_activation_checkpointing``,
``ac_mode``, ``ac_option``) are torchtune's names too, but they are this project's own contract, and their grammar
is the core's (``activation_checkpointing/config.py``)."""
