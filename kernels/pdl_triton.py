"""The device side of programmatic dependent launch (kernels/pdl.py): what every Triton kernel of kernels/ runs
first. Imported only where Triton is installed."""

import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait


@triton.jit
def await_inputs(PDL: tl.constexpr):
    """Wait until the kernel before this one on the stream has finished and its writes are visible, then let the
    next kernel's blocks be placed (they wait the same way, so the order of results is the stream's). A no-op when
    PDL is off (DEEPINFER_PDL off, a device older than sm_90, or Triton's interpreter: kernels/pdl.py)."""
    if PDL:
        gdc_wait()
        gdc_launch_dependents()
