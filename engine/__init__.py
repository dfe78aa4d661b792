"""deepinfer: an inference engine and benchmark-and-eval harness for DeepSeek-V4-family models."""

from .env import configure_logging

configure_logging()

from .api import load_model  # noqa: E402
from .errors import DeepInferError  # noqa: E402
from .llm import LLM  # noqa: E402
from .outputs import CompletionOutput, RequestOutput  # noqa: E402
from .sampling import SamplingParams  # noqa: E402

__version__ = "0.1.0"
__all__ = ["LLM", "SamplingParams", "RequestOutput", "CompletionOutput", "load_model", "DeepInferError",
           "__version__"]
