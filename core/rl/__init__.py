"""The RL contract: rollouts, the algorithm base class, its capabilities and shared parts."""
