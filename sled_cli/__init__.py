"""The `sled` command line: serve, generate, bench, demo."""
