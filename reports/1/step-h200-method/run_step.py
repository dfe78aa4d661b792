"""Drive deepinfer-bench step's run_step_bench (copied from the rebuilt harness) on whichever deepinfer is on
the path: python run_step.py OUT_DIR MODEL STORAGE BATCHES CONTEXTS PREFILL ITERS DEVICE DTYPE"""
import sys

from deepinfer.harness.step_bench import StepConfig, run_step_bench, table

out, model, storage, batches, contexts, prefill, iters, device, dtype = sys.argv[1:10]
ints = lambda s: tuple(int(x) for x in s.split(",") if x)   # noqa: E731
cfg = StepConfig(model=model, device=device, dtype=dtype, expert_storage=storage, batches=ints(batches),
                 contexts=ints(contexts), prefill=ints(prefill), iters=int(iters), warmup=2, trace_steps=3)
run_dir, rows = run_step_bench(cfg, out=out, continue_on_error=True, echo=print)
print("\n".join(table(rows)))
