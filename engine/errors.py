"""The one exception type users see: a single line saying what is wrong and what to do."""


class DeepInferError(Exception):
    """A user-facing error. The CLI prints `str(err)` alone, never a traceback."""


class ConfigError(DeepInferError, ValueError):
    """config.json (or a config dict) is malformed or inconsistent."""


class CheckpointError(DeepInferError):
    """A checkpoint file or tensor is missing, corrupt or does not match the config."""


class ModelNotFoundError(DeepInferError):
    """A model id could not be resolved to a local directory."""
