"""overlong reward (not yet implemented: registers nothing)."""
