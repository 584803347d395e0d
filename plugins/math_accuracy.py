"""math accuracy reward (not yet implemented: registers nothing)."""
