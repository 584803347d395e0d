"""Bradley-Terry reward model (not yet implemented: registers nothing)."""
