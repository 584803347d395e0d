"""RLOO (not yet implemented: registers nothing)."""
