"""reward-model reward (not yet implemented: registers nothing)."""
