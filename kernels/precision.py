"""Accumulation precision of the reference ops: at least fp32; a float64 model stays float64 throughout
(that is how tests take fp32 rounding noise out of a comparison)."""

import torch


def upcast(x: torch.Tensor) -> torch.Tensor:
    return x if x.dtype == torch.float64 else x.float()
