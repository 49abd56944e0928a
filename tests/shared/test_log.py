"""vt's logger: names as asked, third-party import chatter quiet, everything else through."""

from __future__ import annotations

import logging

from vt.shared.log import QUIET_LOGGERS, QUIET_MESSAGES, get_logger


def test_loggers_keep_their_names_and_only_the_listed_chatter_is_dropped(caplog):
    assert get_logger("vt.precompute").name == "vt.precompute"
    assert get_logger("train").name == "vt.train"
    assert all(logging.getLogger(name).getEffectiveLevel() == logging.ERROR for name in QUIET_LOGGERS)

    (logger_name, prefix), = QUIET_MESSAGES.items()
    logger = logging.getLogger(logger_name)
    with caplog.at_level(logging.WARNING, logger=logger_name):
        logger.warning(prefix + " and the API may be subject to change.")
        logger.warning("Some weights of the model checkpoint were not used")
    assert [r.getMessage() for r in caplog.records] == ["Some weights of the model checkpoint were not used"]


def test_vt_lines_go_to_the_stderr_of_the_moment(capsys):
    """A handler bound to the stderr of its set-up would write to a closed stream once a tool that
    swapped stderr (a CLI runner, a tracker's console capture) restores it."""
    get_logger("vt.test").warning("to the current stderr")
    assert "to the current stderr" in capsys.readouterr().err
