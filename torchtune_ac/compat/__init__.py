"""What exists only for users of other tools: ``torchtune/`` (``tune migrate``, and the component paths that mirror
torchtune's)."""
