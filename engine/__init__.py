"""deepinfer: an inference engine and benchmark-and-eval harness for DeepSeek-V4-family models."""

from .api import load_model
from .errors import DeepInferError
from .sampling import SamplingParams

__version__ = "0.1.0"
__all__ = ["load_model", "DeepInferError", "SamplingParams", "__version__"]
