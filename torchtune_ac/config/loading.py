"""Find a YAML config (built-in name or path), apply Hydra overrides, resolve interpolations.

Overrides use Hydra's own grammar, parsed by hydra-core: ``key=value``, ``a.b=value``, ``+new.key=value``,
``~key``, lists ``[1,2]``. Every failure becomes a one-line ``UserError`` naming the file or the override.
"""

from __future__ import annotations

import difflib
import os
import re
from pathlib import Path
from typing import Optional, Sequence

import yaml
from hydra import compose, initialize
from hydra.core.config_store import ConfigStore
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.core.override_parser.types import OverrideType
from hydra.errors import ConfigCompositionException, HydraException, MissingConfigException
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from torchtune_ac.errors import UserError
from torchtune_ac.registry import builtin_config_names, builtin_config_path


def register_resolvers() -> None:
    """Register torchtune_ac's OmegaConf resolvers (idempotent).

    ``${embedded_checkpoint:}`` is the path of the embedded tiny checkpoint (``${embedded_vlm_checkpoint:}``, of
    the tiny vision-language one). Resolving it writes nothing (``tune
    validate`` writes nothing anywhere); ``tune run`` creates it (``create_embedded_checkpoint_if_named``).
    """
    if OmegaConf.has_resolver("embedded_checkpoint"):
        return

    def _embedded_checkpoint() -> str:
        from torchtune_ac.embedded import embedded_checkpoint_dir

        return str(embedded_checkpoint_dir())

    def _embedded_vlm_checkpoint() -> str:
        from torchtune_ac.embedded import embedded_vlm_checkpoint_dir

        return str(embedded_vlm_checkpoint_dir())

    # Not cached: the cache directory comes from $TORCHTUNE_AC_CACHE, which may change between loads.
    OmegaConf.register_new_resolver("embedded_checkpoint", _embedded_checkpoint)
    OmegaConf.register_new_resolver("embedded_vlm_checkpoint", _embedded_vlm_checkpoint)


def create_embedded_checkpoint_if_named(cfg: DictConfig) -> None:
    """Write the embedded checkpoint if a value of the resolved ``cfg`` is its directory or a path inside it
    (``tune run`` only: the run reads it; ``tune validate`` reports it missing like any other file)."""
    from torchtune_ac.embedded import (embedded_checkpoint_dir, embedded_vlm_checkpoint_dir, ensure_embedded_checkpoint,
                                       ensure_embedded_vlm_checkpoint)

    def names_it(value: object, target: Path) -> bool:
        if isinstance(value, dict):
            return any(names_it(v, target) for v in value.values())
        if isinstance(value, list):
            return any(names_it(v, target) for v in value)
        if not isinstance(value, str) or not value:
            return False
        path = Path(value).expanduser().absolute()
        return path == target or target in path.parents

    resolved = OmegaConf.to_container(cfg, resolve=True)
    for directory, ensure in ((embedded_checkpoint_dir, ensure_embedded_checkpoint),
                              (embedded_vlm_checkpoint_dir, ensure_embedded_vlm_checkpoint)):
        if names_it(resolved, directory().expanduser().absolute()):
            ensure()


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
    hint = suggest_config_name(config, builtin_config_names())
    suggestion = f"did you mean {hint}? " if hint else ""
    raise UserError(f"config {config}: not a file and not a built-in config ({suggestion}see `tune ls`)")


# torchtune's names of adapter configs, recipes and model builders (``1B_lora_single_device``, ``8B_qlora``,
# ``lora_finetune_distributed``, ``lora_llama3_2_1b``, ``7B_dora``).
ADAPTER_NAME = re.compile(r"(?:^|(?<=[/_]))q?(?:lora|dora)(?=_|$)")


def suggest_config_name(config: str, names: Sequence[str]) -> Optional[str]:
    """The built-in config ``config`` most likely means, or None.

    A config of the same family whose name starts ``config`` wins (torchtune's ``llama3_2/1B_full_single_device``
    is ``llama3_2/1B_full`` here: one config serves one device and many), then the closest spelling within the
    family, then the closest of all.
    """
    family = config.partition("/")[0]
    same_family = [name for name in names if name.partition("/")[0] == family]
    prefixes = [name for name in same_family if config.startswith(f"{name}_")]
    if prefixes:
        return max(prefixes, key=len)
    close = difflib.get_close_matches(config, same_family, n=1) or difflib.get_close_matches(config, names, n=1)
    return close[0] if close else None


def _describe_yaml_error(path: Path, err: yaml.YAMLError) -> str:
    mark = getattr(err, "problem_mark", None)
    problem = getattr(err, "problem", None) or str(err).splitlines()[0]
    where = f"{path}:{mark.line + 1}:{mark.column + 1}" if mark is not None else str(path)
    return f"{where}: invalid YAML: {problem}"


# Name under which the YAML being loaded is put into Hydra's ConfigStore for composing (replaced each load).
_STORED_CONFIG_NAME = "torchtune_ac_config"


def load_config(config: str, overrides: Sequence[str] = ()) -> DictConfig:
    """Load ``config`` (name or path), apply Hydra ``overrides`` and resolve interpolations.

    The YAML is read by OmegaConf and composed by Hydra from its ConfigStore, not from the YAML's folder: a
    folder next to the file (``checkpoint_dir/``, say) must not turn into a Hydra config group that captures
    the override ``checkpoint_dir=...``.

    Returns:
        The composed config, fully resolved, with struct mode off.

    Raises:
        UserError: missing/unreadable/invalid YAML, Hydra settings in it, a malformed override, ``+key`` for a
            key that exists, ``~key`` for one that does not, or an interpolation that cannot be resolved.
    """
    path = resolve_config_path(config)
    raw = _read_yaml(path)
    register_resolvers()
    ConfigStore.instance().store(name=_STORED_CONFIG_NAME, node=raw)
    try:
        with initialize(config_path=None, version_base=None):
            cfg = compose(config_name=_STORED_CONFIG_NAME, overrides=parse_overrides(overrides))
    except ConfigCompositionException as err:
        message = " ".join(str(err).split())
        if message.startswith(("Could not override", "Could not delete", "Could not append")):
            raise UserError(f"override: {message}") from None
        cause = f": {_first_line(err.__cause__)}" if err.__cause__ is not None else ""
        raise UserError(f"config {path}: {message}{cause}") from None
    except (MissingConfigException, OmegaConfBaseException) as err:
        raise UserError(f"config {path}: {_first_line(err)}") from None

    OmegaConf.set_struct(cfg, False)
    try:
        OmegaConf.resolve(cfg)
    except OmegaConfBaseException as err:
        key = getattr(err, "full_key", None)
        raise UserError(f"config {path}: cannot resolve {key or 'an interpolation'}: {_first_line(err)}") from None
    return cfg


def _read_yaml(path: Path) -> DictConfig:
    """The YAML mapping in ``path``.

    Raises:
        UserError: naming the file (and the line, for invalid YAML): unreadable, not YAML, not a mapping, or
            holding a top-level ``hydra`` key (Hydra would act on it while composing: ``hydra.searchpath``
            entries such as ``pkg://name`` import that package; no recipe reads it).
    """
    try:
        raw = OmegaConf.load(path)
    except yaml.YAMLError as err:
        raise UserError(_describe_yaml_error(path, err)) from None
    except (OmegaConfBaseException, OSError, UnicodeDecodeError) as err:
        raise UserError(f"config {path}: {_first_line(err)}") from None
    if not isinstance(raw, DictConfig):
        raise UserError(f"config {path}: expected a mapping of keys to values at the top level, not a list")
    if "hydra" in raw:
        raise UserError(f"config {path}: the `hydra` key is not supported (Hydra settings are not taken from configs)")
    return raw


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
                f"malformed override {override!r}: {detail or 'cannot parse'} ({_override_hint(override)})"
            ) from None
        if parsed.key_or_group == "hydra" or parsed.key_or_group.startswith(("hydra.", "hydra/")):
            raise UserError(f"override {override!r}: Hydra's own settings cannot be changed here")
        rewritten.append(f"++{override}" if parsed.type is OverrideType.CHANGE else override)
    return rewritten


def _override_hint(override: str) -> str:
    """How to write ``override`` so that it parses: quoted, when its value holds what Hydra's grammar leaves to
    quoted strings (any non-ASCII character, such as ``ä`` in a path); else the grammar."""
    key, sep, value = override.partition("=")
    if sep and not value.isascii() and value[:1] not in ("'", '"'):
        if "'" in value:
            return f"a value with non-ASCII characters must be quoted: {key}=\"{value}\""
        return f"a value with non-ASCII characters must be quoted: {key}='{value}', in a shell \"{key}='{value}'\""
    return "grammar: key=value, +new.key=value, ~key, key=[1,2]"


def _first_line(err: BaseException) -> str:
    lines = [line for line in str(err).splitlines() if line.strip() and not line.startswith("    ")]
    text = lines[0] if lines else type(err).__name__
    # OmegaConf appends "full_key: ..., object_type=..." context lines; keep the human part.
    return text.strip()
