"""Range checks shared by the config sections; each raises a ValueError naming section.key."""

from __future__ import annotations


def positive(section: str, **values: int | float) -> None:
    for key, value in values.items():
        if value <= 0:
            raise ValueError(f"{section}.{key} must be > 0, got {value}")


def non_negative(section: str, **values: int | float) -> None:
    for key, value in values.items():
        if value < 0:
            raise ValueError(f"{section}.{key} must be >= 0, got {value}")
