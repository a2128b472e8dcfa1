"""The memory switches: one module each, defining ``SWITCH`` (see ``torchtune_ac/memory/switch.py``). Modules
here are found by ``discover_switches``; nothing lists them."""
