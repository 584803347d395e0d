"""ORPO (not yet implemented: registers nothing)."""
