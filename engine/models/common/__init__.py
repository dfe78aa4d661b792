"""Blocks both model families share: layers, rope, mHC, MoE, the latent attention's projections, QAT steps and the
pooled-state reads."""
