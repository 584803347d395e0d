"""Builders the tests share: the tiny model, stage contexts and RL rollouts."""
