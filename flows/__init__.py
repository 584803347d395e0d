"""alignflow.flows: Prefect flows and the stage tasks they chain."""
