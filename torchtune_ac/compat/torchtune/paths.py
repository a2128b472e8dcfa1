"""Component paths that mirror torchtune's, for a torchtune user's configs and habits: a module path here stands for
the module that holds its objects (``config/components.py`` imports through this table; the path itself stays as
the config wrote it, in the saved config).

    torchtune_ac.training.metric_logging.WandBLogger      (torchtune: torchtune.training.metric_logging.WandBLogger)
        -> torchtune_ac.observability.metric_logging.WandBLogger
"""

from __future__ import annotations

# module alias -> the module it stands for (both under torchtune_ac: the allow-list checks what is found there).
TORCHTUNE_MODULE_ALIASES = {
    "torchtune_ac.training.metric_logging": "torchtune_ac.observability.metric_logging",
}


def resolve_alias(path: str) -> str:
    """``path`` with a mirrored module replaced by the one it stands for (other paths unchanged)."""
    for alias, module in TORCHTUNE_MODULE_ALIASES.items():
        if path.startswith(alias + "."):
            return module + path[len(alias):]
    return path
