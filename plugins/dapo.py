"""DAPO (not yet implemented: registers nothing)."""
