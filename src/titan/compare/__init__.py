"""Recipe comparison harness (`python -m titan.compare`)."""
