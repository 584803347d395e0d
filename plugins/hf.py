"""transformers generate sampler (not yet implemented: registers nothing)."""
