"""IPO (not yet implemented: registers nothing)."""
