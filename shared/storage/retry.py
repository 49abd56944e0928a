"""Transient failures (connection refused or reset, timeouts, HTTP 5xx, throttling, a conditional write's 409
conflict), told apart from the protocol's answers (404, 412, 403), and the one bounded backoff that retries them."""

from __future__ import annotations

import os
import random
from dataclasses import dataclass

from vt.shared.errors import UserError

_TRANSIENT_CODES = {
    "SlowDown",
    "Throttling",
    "ThrottlingException",
    "TooManyRequests",
    "RequestTimeout",
    "InternalError",
    "ServiceUnavailable",
    "RequestLimitExceeded",
    "ProvisionedThroughputExceeded",
    # 409: AWS's answer to a conditional write racing another for the same key (two `If-None-Match: *`
    # creates at once): this one was not applied, and AWS documents a retry, whose 412 then says the
    # other won (shared/storage Storage.create_exclusive).
    "ConditionalRequestConflict",
}


class StorageUnavailable(UserError, OSError):
    """A storage operation kept failing with transient errors until the retry budget was spent."""


@dataclass(frozen=True)
class RetryPolicy:
    """Bounded retries with exponential backoff: wait ~base * 2**n (capped), half of it jittered.

    The defaults (10 attempts) give up after 10.7-21.3 s of waiting (`wait_range`): a store restart or a
    brown-out of about 10 s is ridden out. VT_STORAGE_RETRY_SECONDS sets the budget as wall time instead
    (attempts go on until the next wait would pass it), VT_STORAGE_RETRIES as attempts.
    """

    attempts: int = 10  # tries per operation, the first included
    base_seconds: float = 0.1
    max_seconds: float = 5.0
    seconds: float | None = None  # a wall-time budget instead of `attempts`

    def delay(self, failures: int) -> float:
        ceiling = self._ceiling(failures)
        return ceiling / 2 + random.uniform(0, ceiling / 2)

    def _ceiling(self, failures: int) -> float:
        return min(self.max_seconds, self.base_seconds * 2 ** (failures - 1))

    def gives_up(self, failures: int, elapsed: float, delay: float) -> bool:
        """Whether to stop after `failures` failed tries, `elapsed` seconds in, rather than wait `delay` more."""
        if self.seconds is not None:
            return elapsed + delay > self.seconds
        return failures >= self.attempts

    def wait_range(self) -> tuple[float, float]:
        """The least and most seconds of waiting before the attempts are spent (jitter spans the two)."""
        ceilings = [self._ceiling(n) for n in range(1, self.attempts)]
        return sum(ceilings) / 2, sum(ceilings)

    @classmethod
    def from_env(cls) -> "RetryPolicy":
        seconds = os.environ.get("VT_STORAGE_RETRY_SECONDS", "")
        if seconds:
            try:
                value = float(seconds)
            except ValueError:
                value = -1.0
            if not value > 0:
                raise UserError(f"VT_STORAGE_RETRY_SECONDS={seconds!r} must be a positive number of seconds")
            return cls(seconds=value)
        raw = os.environ.get("VT_STORAGE_RETRIES", "")
        if not raw:
            return cls()
        if not raw.isdigit() or int(raw) < 1:
            raise UserError(f"VT_STORAGE_RETRIES={raw!r} must be a positive integer (attempts per operation)")
        return cls(attempts=int(raw))

    def describe(self) -> str:
        if self.seconds is not None:
            return f"{self.seconds:g} s (VT_STORAGE_RETRY_SECONDS)"
        low, high = self.wait_range()
        return f"{self.attempts} attempts, {low:.1f}-{high:.1f} s of waiting (VT_STORAGE_RETRIES)"


def is_transient(err: BaseException) -> bool:
    """True for failures a retry can cure (network, timeouts, 5xx, throttling); False for answers."""
    if isinstance(err, (FileNotFoundError, FileExistsError, PermissionError, IsADirectoryError, NotADirectoryError)):
        return False
    seen = set()
    while err is not None and id(err) not in seen:
        seen.add(id(err))
        if isinstance(err, (ConnectionError, TimeoutError)):  # refused, reset, broken pipe, socket timeouts
            return True
        module = type(err).__module__
        if module.startswith("aiohttp"):  # connection-level errors of s3fs's HTTP client
            return True
        if module.startswith("botocore"):
            response = getattr(err, "response", None)
            if response is None:  # BotoCoreError: endpoint connection, read timeout, parse error ...
                return type(err).__name__ not in (
                    "NoCredentialsError",
                    "ParamValidationError",
                    "PartialCredentialsError",
                    "ProfileNotFound",
                )
            status = response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0)
            code = response.get("Error", {}).get("Code", "")
            return status >= 500 or status == 429 or code in _TRANSIENT_CODES
        if type(err).__name__ == "FSTimeoutError":
            return True
        err = err.__cause__ or err.__context__
    return False
