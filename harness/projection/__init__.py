"""The projection of expert-parallel deployments the local machine cannot launch (docs/projection.md)."""
