"""The `rl` stage: the loop, rollouts, updates and each capability's stage code."""
