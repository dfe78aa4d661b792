"""Model configs: read config.json in any accepted spelling into one typed config per model family."""

from __future__ import annotations

import json
from pathlib import Path

from ..errors import ConfigError
from .deepseek_v4 import DeepseekV4Config, parse_deepseek_v4
from .deepseek_v41 import DeepseekV41Config, parse_deepseek_v41

# model_type -> config class, the default (the embedded tiny model's and the default hub checkpoint's) first
CONFIG_CLASSES = {"deepseek_v41": DeepseekV41Config, "deepseek_v4": DeepseekV4Config}

# model_type -> parser. deepseek_v41 is transformers' composite config, deepseek_v41_text its bare text config.
CONFIG_PARSERS = {"deepseek_v4": parse_deepseek_v4, "deepseek_v41": parse_deepseek_v41,
                  "deepseek_v41_text": parse_deepseek_v41}


def parse_model_config(raw: dict):
    """Dispatch on `model_type`; unknown types get one line listing what is supported."""
    if not isinstance(raw, dict):
        raise ConfigError("config.json must hold a JSON object")
    model_type = raw.get("model_type")
    if model_type not in CONFIG_PARSERS:
        raise ConfigError(f"model_type {model_type!r} is not supported; supported: {sorted(CONFIG_PARSERS)}")
    return CONFIG_PARSERS[model_type](raw)


def load_model_config(path: str | Path):
    """Read `<dir>/config.json` (or a config.json path)."""
    path = Path(path)
    if path.is_dir():
        path = path / "config.json"
    if not path.is_file():
        raise ConfigError(f"{path} does not exist: a checkpoint directory needs a config.json")
    try:
        raw = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise ConfigError(f"{path} is not valid JSON ({err}); fix or re-download it") from None
    except OSError as err:
        raise ConfigError(f"{path} could not be read ({err.strerror or err}); check its permissions") from None
    try:
        return parse_model_config(raw)
    except ConfigError as err:
        raise ConfigError(f"{path}: {err}") from None


__all__ = ["DeepseekV4Config", "DeepseekV41Config", "parse_model_config", "load_model_config", "CONFIG_CLASSES",
           "CONFIG_PARSERS"]
