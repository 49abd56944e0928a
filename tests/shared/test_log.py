"""vt's logger: names as asked, third-party import chatter quiet, everything else through."""

from __future__ import annotations

import logging
import os

from vt.shared.log import QUIET_LOGGERS, QUIET_MESSAGES, get_logger


def test_loggers_keep_their_names_and_only_the_listed_chatter_is_dropped(caplog):
    assert get_logger("vt.precompute").name == "vt.precompute"
    assert get_logger("train").name == "vt.train"
    assert all(logging.getLogger(name).getEffectiveLevel() == logging.ERROR for name in QUIET_LOGGERS)

    ((logger_name, prefix),) = QUIET_MESSAGES.items()
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


def test_info_hides_the_libraries_bars_and_notices_and_debug_shows_them(monkeypatch):
    import transformers.utils.logging as transformers_logging

    from vt.shared.log import QUIET_ENVIRONMENT, apply_level

    for name in QUIET_ENVIRONMENT:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("TRANSFORMERS_VERBOSITY", "info")  # a value the user set wins over vt's
    verbosity = transformers_logging.get_verbosity()
    try:
        transformers_logging.enable_progress_bar()
        apply_level("info")
        assert not transformers_logging.is_progress_bar_enabled()  # imported already: told directly
        assert transformers_logging.get_verbosity() == logging.ERROR
        assert [os.environ[name] for name in ("HF_HUB_DISABLE_PROGRESS_BARS", "TRANSFORMERS_VERBOSITY")] == [
            "1",
            "info",
        ]
        assert get_logger().level == logging.INFO

        transformers_logging.enable_progress_bar()
        apply_level("debug")
        assert transformers_logging.is_progress_bar_enabled() and get_logger().level == logging.DEBUG
    finally:
        transformers_logging.enable_progress_bar()
        transformers_logging.set_verbosity(verbosity)
        get_logger().setLevel(logging.INFO)
