"""What an exception in the processor chain means: bad data (the sample is rejected) or a bug (the run stops).

The policy is passed in (`Chain.prepare(..., policy=...)`), as webdataset's stages take a `handler`,
rather than a try/except in the service that turns everything into a reject: a processor with a
bug then looked like a hundred bad clips and stopped the run as "too many failures in a row".
`bad_data_only`, the service's policy, rejects

- SampleError: a processor (or the source, or decode.py for a corrupt, empty, audio-only or
  too-short file) said why this sample cannot be used; its reason is kept as it is;
- av.FFmpegError (PyAV's errors, e.g. InvalidDataError): the decoder failed on the media, rejected
  as `corrupt_video` (decode.py turns those it foresees into SampleError itself);

and raises ProcessorBug for anything else (TypeError, KeyError, AttributeError ...), naming the
step and the sample, with the traceback formatted where it happened: in a decode worker process
the exception pickles back to the service as plain strings, so the processor's own frames survive.
"""

from __future__ import annotations

import traceback
from collections.abc import Callable

import av

from .errors import SampleError

# (exception, step name, sample key) -> the SampleError that rejects the sample; raises to stop the run.
ErrorPolicy = Callable[[Exception, str, str], SampleError]


class ProcessorBug(RuntimeError):
    """A step of the chain raised something other than bad data: the run stops, nothing is rejected."""

    def __init__(self, step: str, key: str, error: str, traceback_text: str):
        super().__init__(step, key, error, traceback_text)  # all in args: pickles across worker processes
        self.step, self.key, self.error, self.traceback = step, key, error, traceback_text

    def __str__(self) -> str:
        return (
            f"processor {self.step!r} raised {self.error} on sample {self.key!r} "
            "(a bug in the processor, not bad data; traceback above)"
        )


def bad_data_only(err: Exception, step: str, key: str) -> SampleError:
    """Reject the sample for bad data (SampleError, PyAV's errors); raise ProcessorBug for anything else."""
    if isinstance(err, SampleError):
        return err
    if isinstance(err, av.FFmpegError):
        return SampleError("corrupt_video", f"PyAV failed in {step!r}: {err}")
    text = "".join(traceback.format_exception(type(err), err, err.__traceback__))
    raise ProcessorBug(step, key, f"{type(err).__name__}: {err}", text) from err
