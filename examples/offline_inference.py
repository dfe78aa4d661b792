"""Offline inference, as vLLM users know it.

    python examples/offline_inference.py                       # the default checkpoint from the hub
    python examples/offline_inference.py --model /path/to/ckpt --device cuda --dtype bfloat16
    python examples/offline_inference.py --model tiny          # the embedded tiny model, CPU seconds
"""

from __future__ import annotations

import argparse

from deepinfer import LLM, SamplingParams
from deepinfer.checkpoint.hub import DEFAULT_MODEL_ID
from deepinfer.cli import run_cli

PROMPTS = ["Hello, my name is", "The president of the United States is", "The capital of France is",
           "The future of AI is"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=DEFAULT_MODEL_ID, help="checkpoint dir, hub id, or 'tiny'")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--max-tokens", type=int, default=32)
    args = ap.parse_args()
    llm = LLM(model=args.model, device=args.device, dtype=args.dtype)
    outputs = llm.generate(PROMPTS, SamplingParams(temperature=0.8, top_p=0.95, max_tokens=args.max_tokens, seed=0))
    for out in outputs:
        print(f"Prompt: {out.prompt!r}, Generated text: {out.outputs[0].text!r}")


if __name__ == "__main__":
    run_cli(main)
