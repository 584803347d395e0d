"""code execution reward (not yet implemented: registers nothing)."""
