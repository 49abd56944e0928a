"""Stage 1 processors: raw sample -> samples fitted to a bucket, ready for the model's encoders.

The work needs no model: probe, choose a bucket, pick timestamps, decode only those frames (scaled
by FFmpeg straight to the size that covers the bucket), crop, and adjust the caption. It is a chain
of small processors (`chain.py`; the configured list `precompute.processors` is resolved by
vt.shared.chain, the contract in docs/processors.md) that returns plain tensors, so the service
can run it in worker processes (set up by `worker_init`). Anything wrong with the sample comes out
as SampleError (reason counted in the report); an exception that is not bad data is a bug and stops
the run as ProcessorBug, naming the processor (the error policy, `policy.py`).
"""

from __future__ import annotations

import torch

from vt.shared.buckets import Bucket

from ..sources import RawSample
from .chain import Chain, build_chain
from .decode import Clip, VideoInfo, decode_at, probe
from .errors import SampleError
from .fit_bucket import fit_pixels, fit_to_bucket, to_model_range
from .policy import ErrorPolicy, ProcessorBug, bad_data_only
from .prepared import PreparedSample
from .sample import Processor, Sample
from .sample_frames import sample_times, usable_frames
from .sound import SoundRequest, decode_sound

__all__ = [
    "Chain",
    "Clip",
    "ErrorPolicy",
    "PreparedSample",
    "Processor",
    "ProcessorBug",
    "Sample",
    "SampleError",
    "SoundRequest",
    "VideoInfo",
    "bad_data_only",
    "build_chain",
    "decode_at",
    "decode_sound",
    "fit_pixels",
    "fit_to_bucket",
    "prepare_sample",
    "probe",
    "sample_times",
    "to_model_range",
    "usable_frames",
    "worker_init",
]


def prepare_sample(raw: RawSample, buckets: list[Bucket], fps: float) -> PreparedSample:
    """The default chain (start of the clip, centered crop) on one sample: its one prepared sample.

    The prepared sample's key is the raw sample's `sample_id` (raw shard name and key).
    """
    (prepared,) = build_chain([]).prepare(raw, buckets, fps)
    return prepared


def worker_init() -> None:
    """Set up a decode worker process: one torch thread, quiet FFmpeg.

    Decoding is single-threaded per clip and the worker's torch work is a crop and a conversion,
    so more threads would only fight the encoder process (and the other workers) for cores.
    FFmpeg logs every damaged packet of a bad clip to stderr; the service counts those clips.
    """
    import av.logging

    torch.set_num_threads(1)
    av.logging.set_level(av.logging.PANIC)
