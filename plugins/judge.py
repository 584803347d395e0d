"""judge reward (not yet implemented: registers nothing)."""
