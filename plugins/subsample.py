"""seeded random subset selector (not yet implemented: registers nothing)."""
