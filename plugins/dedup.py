"""exact-duplicate prompt removal selector (not yet implemented: registers nothing)."""
