"""length reward (not yet implemented: registers nothing)."""
