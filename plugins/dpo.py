"""DPO (not yet implemented: registers nothing)."""
