"""An example third-party alignflow plugin package."""
