"""Config: YAML loading with Hydra overrides, typed schemas, allow-listed ``_component_`` instantiation."""

from torchtune_ac.config.components import Component, check_component_path, import_component, parse_component
from torchtune_ac.config.loading import load_config, register_resolvers, resolve_config_path
from torchtune_ac.config.schema import Device, DType, FSDPConfig, FullFinetuneConfig
from torchtune_ac.config.validation import ConfigError, validate_config

__all__ = [
    "Component",
    "ConfigError",
    "DType",
    "Device",
    "FSDPConfig",
    "FullFinetuneConfig",
    "check_component_path",
    "import_component",
    "load_config",
    "parse_component",
    "register_resolvers",
    "resolve_config_path",
    "validate_config",
]
