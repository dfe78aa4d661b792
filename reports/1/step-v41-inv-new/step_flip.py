"""One-off: `deepinfer-bench ARGS` with the invariant dense GEMMs of kernels/matmul_triton.py in ('with') or out of
('without') the triton_invariant set."""
import sys
from deepinfer.kernels import registry
if sys.argv[1] == "without":
    for op in ("linear", "grouped_linear"):
        registry.OPS[op].pop("triton_invariant", None)
from deepinfer.harness.cli import main
sys.argv = ["deepinfer-bench"] + sys.argv[2:]
main()
