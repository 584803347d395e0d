"""SimPO (not yet implemented: registers nothing)."""
