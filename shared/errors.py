"""The one type of a user's error: a config, data or files that the message says how to fix.

The CLIs print a `UserError` as one line and exit 1; any other exception is a bug in vt (or in a library it
calls) and keeps its traceback. It is a ValueError, so code that catches ValueError keeps working; the errors
of a particular kind (ConfigError, ModelLoadError, StaleShardError, ...) subclass it.
"""

from __future__ import annotations


class UserError(ValueError):
    """A mistake in what the user gave (config, data, weights, environment), with what to do about it."""
