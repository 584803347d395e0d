"""column-value filter selector (not yet implemented: registers nothing)."""
