"""Pipeline specs: the YAML's models, stage kinds, settings and loops."""
