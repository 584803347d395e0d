"""GRPO (not yet implemented: registers nothing)."""
