"""alignflow.plugins: the built-in plugins, each loaded through the `alignflow` entry-point group."""
