"""Training machinery: models, datasets, the DeepSpeed engine, checkpoints, memory estimates."""
