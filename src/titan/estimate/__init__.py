"""Dry runs of a layout on a fake process group: memory, collectives and step time per rank."""
