"""Find a YAML config (built-in name or path), apply Hydra overrides, resolve interpolations.

Overrides use Hydra's own grammar, parsed by hydra-core: ``key=value``, ``a.b=value``, ``+new.key=value``,
``~key``, lists ``[1,2]``. Every failure becomes a one-line ``UserError`` naming the file or the override.
"""

from __future__ import annotations

import difflib
import os
from pathlib import Path
from typing import Sequence

import yaml
from hydra import compose, initialize_config_dir
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.core.override_parser.types import OverrideType
from hydra.errors import ConfigCompositionException, HydraException, MissingConfigException
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from torchtune_ac.errors import UserError
from torchtune_ac.registry import builtin_config_names, builtin_config_path


def register_resolvers() -> None:
    """Register torchtune_ac's OmegaConf resolvers (idempotent).

    ``${embedded_checkpoint:}`` is the path of the embedded tiny checkpoint, written on first use.
    """
    if OmegaConf.has_resolver("embedded_checkpoint"):
        return

    def _embedded_checkpoint() -> str:
        from torchtune_ac.models import ensure_embedded_checkpoint

        return str(ensure_embedded_checkpoint())

    OmegaConf.register_new_resolver("embedded_checkpoint", _embedded_checkpoint, use_cache=True)


def resolve_config_path(config: str) -> Path:
    """Return the YAML file for ``config``: an existing file path, or a built-in name such as ``llama3/8B_full``.

    Raises:
        UserError: neither a readable file nor a built-in config name.
    """
    path = Path(config).expanduser()
    if path.is_file():
        if path.suffix not in (".yaml", ".yml"):
            raise UserError(f"config {config}: expected a .yaml or .yml file")
        if not os.access(path, os.R_OK):
            raise UserError(f"config {config}: file is not readable")
        return path.resolve()
    builtin = builtin_config_path(config)
    if builtin is not None:
        return builtin
    if path.suffix in (".yaml", ".yml"):
        raise UserError(f"config {config}: no such file")
    hint = difflib.get_close_matches(config, builtin_config_names(), n=1)
    suggestion = f"did you mean {hint[0]}? " if hint else ""
    raise UserError(f"config {config}: not a file and not a built-in config ({suggestion}see `tune ls`)")


def _describe_yaml_error(path: Path, err: yaml.YAMLError) -> str:
    mark = getattr(err, "problem_mark", None)
    problem = getattr(err, "problem", None) or str(err).splitlines()[0]
    where = f"{path}:{mark.line + 1}:{mark.column + 1}" if mark is not None else str(path)
    return f"{where}: invalid YAML: {problem}"


def load_config(config: str, overrides: Sequence[str] = ()) -> DictConfig:
    """Load ``config`` (name or path), apply Hydra ``overrides`` and resolve interpolations.

    Returns:
        The composed config, fully resolved, with struct mode off.

    Raises:
        UserError: missing/unreadable/invalid YAML, a malformed override, ``+key`` for a key that exists,
            ``~key`` for one that does not, or an interpolation that cannot be resolved.
    """
    path = resolve_config_path(config)
    _refuse_hydra_settings(path)
    register_resolvers()
    try:
        with initialize_config_dir(config_dir=str(path.parent), version_base=None):
            cfg = compose(config_name=path.name, overrides=parse_overrides(overrides))
    except yaml.YAMLError as err:
        raise UserError(_describe_yaml_error(path, err)) from None
    except ConfigCompositionException as err:
        message = " ".join(str(err).split())
        if message.startswith(("Could not override", "Could not delete", "Could not append")):
            raise UserError(f"override: {message}") from None
        cause = f": {_first_line(err.__cause__)}" if err.__cause__ is not None else ""
        raise UserError(f"config {path}: {message}{cause}") from None
    except (MissingConfigException, OmegaConfBaseException, OSError, UnicodeDecodeError) as err:
        raise UserError(f"config {path}: {_first_line(err)}") from None

    OmegaConf.set_struct(cfg, False)
    try:
        OmegaConf.resolve(cfg)
    except OmegaConfBaseException as err:
        key = getattr(err, "full_key", None)
        raise UserError(f"config {path}: cannot resolve {key or 'an interpolation'}: {_first_line(err)}") from None
    return cfg


def _refuse_hydra_settings(path: Path) -> None:
    """Refuse a top-level ``hydra`` key: Hydra would act on it while composing (``hydra.searchpath`` entries
    such as ``pkg://name`` import that package), and no recipe reads it.

    Raises:
        UserError: naming the file. A file that does not parse is left to ``compose`` to report.
    """
    try:
        raw = OmegaConf.load(path)
    except Exception:  # noqa: BLE001 - compose reports unreadable or invalid YAML with file and line
        return
    if isinstance(raw, DictConfig) and "hydra" in raw:
        raise UserError(f"config {path}: the `hydra` key is not supported (Hydra settings are not taken from configs)")


def parse_overrides(overrides: Sequence[str]) -> list[str]:
    """Parse each override with Hydra's grammar; return them with ``key=value`` turned into ``++key=value``.

    In Hydra, ``key=value`` may only change a key the YAML already has. Here every key of the recipe's
    schema can be set that way (``ac_mode=selective`` works on a config that does not mention ``ac_mode``),
    and a misspelt key is caught by schema validation with a "did you mean" suggestion instead.

    Raises:
        UserError: naming the first override that does not parse.
    """
    parser = OverridesParser.create()
    rewritten = []
    for override in overrides:
        try:
            parsed = parser.parse_override(override)
        except HydraException as err:
            detail = " ".join(str(err).split("\n")[0].split())
            detail = detail.removeprefix(f"Error parsing override '{override}'").split(" expecting ")[0].strip()
            raise UserError(
                f"malformed override {override!r}: {detail or 'cannot parse'} (grammar: key=value, +new.key=value, ~key, key=[1,2])"
            ) from None
        if parsed.key_or_group == "hydra" or parsed.key_or_group.startswith(("hydra.", "hydra/")):
            raise UserError(f"override {override!r}: Hydra's own settings cannot be changed here")
        rewritten.append(f"++{override}" if parsed.type is OverrideType.CHANGE else override)
    return rewritten


def _first_line(err: BaseException) -> str:
    lines = [line for line in str(err).splitlines() if line.strip() and not line.startswith("    ")]
    text = lines[0] if lines else type(err).__name__
    # OmegaConf appends "full_key: ..., object_type=..." context lines; keep the human part.
    return text.strip()
