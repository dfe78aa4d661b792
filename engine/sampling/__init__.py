"""Sampling: per-request decoding settings and the batched on-device sampler."""

from .params import SamplingParams
from .sampler import SamplingTensors, build_sampling_tensors, logprobs, sample

__all__ = ["SamplingParams", "SamplingTensors", "build_sampling_tensors", "logprobs", "sample"]
