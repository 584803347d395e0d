"""Dr. GRPO (not yet implemented: registers nothing)."""
