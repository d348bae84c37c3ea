"""The shared range checks: each error names section.key and the value given."""

import pytest

from titan.config.checks import non_negative, positive


def test_positive_refuses_zero_naming_the_key_and_value():
    positive("training", steps=1, seq_len=0.5)
    with pytest.raises(ValueError, match=r"^training\.seq_len must be > 0, got 0$"):
        positive("training", steps=1, seq_len=0)


def test_non_negative_accepts_zero_and_refuses_a_negative_naming_the_key():
    non_negative("optimizer", weight_decay=0)
    with pytest.raises(ValueError, match=r"^optimizer\.weight_decay must be >= 0, got -0\.1$"):
        non_negative("optimizer", weight_decay=-0.1)
