"""One-off: where a pure decode step's host time goes at batch B (V4.1 flash:4, FP4 experts, greedy, context ~1k):
per-iteration wall, EngineStats' host fields over the window, and cProfile of the engine's Python."""
import cProfile, dataclasses, pstats, sys, time
import torch
from deepinfer import LLM
from deepinfer.api import resolve_model
from deepinfer.scheduler.request import Request
from deepinfer.sampling.params import SamplingParams

B, STEPS = int(sys.argv[1]), int(sys.argv[2])
import os; DEV = os.environ.get("DEV", "cuda"); SPEC = os.environ.get("SPEC", "random:deepseek_v41:flash:4")
model = resolve_model(SPEC, DEV, "bfloat16", "fp4")
llm = LLM(model=model, device=DEV, dtype="bfloat16", seed=0, expert_storage="fp4", max_num_seqs=256,
          max_num_batched_tokens=16384, max_model_len=int(os.environ.get("MAXLEN", 1536)), **({"gpu_memory_utilization": 0.9} if DEV == "cuda" else {}))
eng = llm.engine
g = torch.Generator().manual_seed(0)
for i in range(B):
    ids = torch.randint(5, int(os.environ.get("VOCAB", 100000)), (1024,), generator=g).tolist()
    eng.add_request(Request(f"r{i}", ids, SamplingParams(temperature=0, max_tokens=400, ignore_eos=True), seed=i))
while any(not r.output_ids for r in eng.scheduler.running) or len(eng.scheduler.running) < B:
    eng.step()
for _ in range(20):
    eng.step()
torch.cuda.synchronize() if DEV == "cuda" else None
c0 = dataclasses.replace(eng._counters)
walls = []
for _ in range(STEPS):
    t = time.perf_counter(); eng.step(); walls.append(time.perf_counter() - t)
c1 = dataclasses.replace(eng._counters)
n = c1.steps - c0.steps
f = lambda k: (getattr(c1, k) - getattr(c0, k)) * 1e3 / n
walls.sort()
print(f"B={B} steps={n} iter median {walls[len(walls)//2]*1e3:.2f} ms  mean {sum(walls)/len(walls)*1e3:.2f}  "
      f"plan {f('host_plan_s'):.2f} launch {f('host_launch_s'):.2f} wait {f('device_wait_s'):.2f} "
      f"apply {f('host_apply_s'):.2f} replays {eng.runner.graph_replays}")
pr = cProfile.Profile(); pr.enable()
for _ in range(STEPS):
    eng.step()
torch.cuda.synchronize() if DEV == "cuda" else None
pr.disable()
st = pstats.Stats(pr)
st.sort_stats("cumulative").print_stats(r"deepinfer|engine/|kernels/|torch/cuda/graphs|_contextlib", 45)
st.sort_stats("tottime").print_stats(25)
