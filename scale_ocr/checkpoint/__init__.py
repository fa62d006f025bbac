"""Resumable checkpoints, their safe reader and manifest, and model exports."""
