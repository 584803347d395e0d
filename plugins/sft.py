"""SFT (not yet implemented: registers nothing)."""
