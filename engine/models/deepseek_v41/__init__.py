"""DeepSeek-V4.1: model.py, block.py, attention.py (CSA2 over the pools), csa2.py, engram.py, dspark.py (drafting)."""

from .model import DeepseekV41ForCausalLM

__all__ = ["DeepseekV41ForCausalLM"]
