"""DisCO (not yet implemented: registers nothing)."""
