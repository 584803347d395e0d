"""REINFORCE++ (not yet implemented: registers nothing)."""
