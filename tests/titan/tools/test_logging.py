"""The titan logger: rank 0 logs info, other ranks only warnings, a [rankN] prefix in multi-rank runs, written to
sys.stdout as it is at the time of the call."""

import logging
import logging.handlers

import pytest

from titan.tools.logging import _CurrentStdout, init_logger, logger


@pytest.fixture
def fresh_logger(monkeypatch):
    saved = logger.handlers[:], logger.level, logger.propagate
    logger.handlers.clear()
    yield monkeypatch
    logger.handlers[:], (logger.level, logger.propagate) = saved[0], saved[1:]


def test_rank_0_of_one_prints_info_without_a_prefix_to_the_current_stdout(fresh_logger, capsys):
    fresh_logger.delenv("RANK", raising=False)
    fresh_logger.delenv("WORLD_SIZE", raising=False)
    init_logger()
    logger.info("hello")
    assert capsys.readouterr().out.split(" ", 1)[1] == "INFO hello\n"


def test_other_ranks_print_warnings_only_with_their_rank(fresh_logger, capsys):
    fresh_logger.setenv("RANK", "3")
    fresh_logger.setenv("WORLD_SIZE", "4")
    init_logger()
    logger.info("hidden")
    logger.warning("shown")
    out = capsys.readouterr().out
    assert out.startswith("[rank3] ") and out.endswith(" WARNING shown\n") and "hidden" not in out
    assert logger.level == logging.WARNING


def test_a_second_init_adds_no_second_handler(fresh_logger):
    init_logger()
    init_logger()
    assert len([h for h in logger.handlers if isinstance(h, _CurrentStdout)]) == 1


def test_a_handler_of_the_users_own_does_not_silence_the_console(fresh_logger, capsys):
    fresh_logger.delenv("RANK", raising=False)
    fresh_logger.delenv("WORLD_SIZE", raising=False)
    kept = logging.handlers.BufferingHandler(10)
    logger.addHandler(kept)
    init_logger()
    logger.info("both")
    assert capsys.readouterr().out.endswith("INFO both\n") and kept.buffer[0].getMessage() == "both"
