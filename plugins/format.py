"""format reward (not yet implemented: registers nothing)."""
