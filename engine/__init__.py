"""deepinfer: an inference engine and benchmark-and-eval harness for DeepSeek-V4-family models."""

from .api import load_model
from .errors import DeepInferError
from .llm import LLM
from .outputs import CompletionOutput, RequestOutput
from .sampling import SamplingParams

__version__ = "0.1.0"
__all__ = ["LLM", "SamplingParams", "RequestOutput", "CompletionOutput", "load_model", "DeepInferError",
           "__version__"]
