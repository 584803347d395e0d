"""KTO (not yet implemented: registers nothing)."""
