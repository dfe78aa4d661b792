"""DeepSeek-V4: model.py (blocks, NextN layers, the model), attention.py, compressor.py, mtp.py (NextN drafting)."""

from .model import DeepseekV4ForCausalLM

__all__ = ["DeepseekV4ForCausalLM"]
