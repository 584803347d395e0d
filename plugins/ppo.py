"""PPO (not yet implemented: registers nothing)."""
