"""The `tandem` command: serve, refit, generate and demo-model."""
