"""Speculative decoding: the engine core's `Speculation` (speculation.py: plan, apply), the verify policy and
its schedules, the step-rate tables, the pinned acceptance model and the lossless rule. The device side (verify
and draft on the step that ran) is the runner's (runner/speculate.py)."""
