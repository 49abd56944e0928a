"""Cut real clips into short captioned samples and write them as raw webdataset shards.

This is the demo's and the tests' stand-in for a crawled data set: each clip is split into
consecutive pieces of `seconds`, re-encoded as h264 (aspect kept, longest side <= max_side, one
keyframe a second so decoders can seek), and written as `<key>.mp4` plus `<key>.txt` (or
`<key>.json` {"caption": ...}) into out/raw-000000.tar, raw-000001.tar, ...

    python scripts/make_sample_shards.py --clips DIR --out DIR [--seconds 1.5] [--per-shard 8] [--max-side 480]

With `--stills N` it writes a folder of media files instead (the pieces as <key>.mp4 plus N still
images per clip as .jpg / .png / .webp, each with <key>.txt): the mixed raw input of images and videos.
With `--control edges` (or `gray`) every piece also gets a control video, `<key>.control.mp4`: the same
frames, timing and size as an edge map (Sobel magnitude of the luma) or as grayscale, what a family that
trains on a control video (pose, depth, edges) reads beside each clip.
With `--sound tone` (or `noise`) every piece gets a sound track muxed beside its frames (stream copy of the
video): a sine whose pitch differs from piece to piece, or seeded white noise, 44.1 kHz stereo AAC as long
as the piece, what a family that trains audio (LTX-2) reads; the default (`none`) writes no sound, as
before.
"""

from __future__ import annotations

import argparse
import io
import itertools
import json
import tarfile
from fractions import Fraction
from pathlib import Path

import av
import numpy as np

CAPTIONS = {
    "bigbuckbunny": "a big cartoon rabbit walks out of his burrow into a sunny green meadow",
    "bikes": "cyclists ride bicycles past the camera along a city street",
    "carphone_pristine": "a man talks on a phone in the passenger seat of a moving car",
    "carphone_distorted": "a blurry, blocky low quality video of a man on a phone in a car",
}


def _even(value: float) -> int:
    return max(2, int(round(value / 2)) * 2)


def _output_size(height: int, width: int, max_side: int) -> tuple[int, int]:
    """Keep the aspect, fit the longest side in max_side; even sizes, as yuv420p needs."""
    scale = min(1.0, max_side / max(height, width))
    return _even(height * scale), _even(width * scale)


class _PieceWriter:
    """Encodes one piece of a clip into mp4 bytes in memory."""

    def __init__(self, rate: Fraction, height: int, width: int):
        self.buffer = io.BytesIO()
        self.container = av.open(self.buffer, mode="w", format="mp4")
        self.stream = self.container.add_stream("libx264", rate=rate)
        self.stream.height, self.stream.width, self.stream.pix_fmt = height, width, "yuv420p"
        self.stream.codec_context.gop_size = max(1, round(rate))  # a keyframe each second
        self.stream.codec_context.options = {"crf": "23", "preset": "veryfast"}
        self.time_base = 1 / Fraction(rate)
        self.count = 0

    def add(self, frame: av.VideoFrame) -> None:
        frame.pts, frame.time_base = self.count, self.time_base
        self.count += 1
        self.container.mux(self.stream.encode(frame))

    def close(self) -> bytes:
        self.container.mux(self.stream.encode(None))
        self.container.close()
        return self.buffer.getvalue()


def cut_clip(clip: Path, seconds: float, max_side: int) -> list[bytes]:
    """The clip as consecutive pieces of `seconds` (a shorter tail is dropped), as mp4 bytes."""
    pieces: list[bytes] = []
    with av.open(str(clip)) as source:
        stream = source.streams.video[0]
        duration = (
            float(stream.duration * stream.time_base) if stream.duration else float(source.duration) / av.time_base
        )
        total = int(duration // seconds)
        rate = stream.average_rate or stream.guessed_rate or Fraction(25)
        height, width = _output_size(stream.codec_context.height, stream.codec_context.width, max_side)
        origin = stream.start_time or 0
        writer, index = None, -1
        for frame in source.decode(stream):
            at = float((frame.pts - origin) * stream.time_base)
            piece = int(at // seconds)
            if piece >= total:
                break
            if piece != index:
                if writer is not None:
                    pieces.append(writer.close())
                writer, index = _PieceWriter(rate, height, width), piece
            writer.add(frame.reformat(width=width, height=height, format="yuv420p", interpolation="AREA"))
        if writer is not None:
            pieces.append(writer.close())
    return pieces


CONTROLS = ("edges", "gray")
SOUNDS = ("tone", "noise", "none")
SOUND_RATE = 44100  # Hz: not a family's rate, so stage 1's resampling is always exercised


def sound_wave(kind: str, seconds: float, index: int = 0, rate: int = SOUND_RATE) -> np.ndarray:
    """(2, samples) float32 stereo: a sine at 220 Hz x (1 + index % 4) with amplitude 0.5 (`tone`), or white noise
    of standard deviation 0.1 seeded by `index` (`noise`)."""
    count = round(seconds * rate)
    if kind == "tone":
        wave = 0.5 * np.sin(2 * np.pi * 220.0 * (1 + index % 4) * np.arange(count) / rate)
        return np.stack([wave, wave]).astype(np.float32)
    if kind == "noise":
        return np.clip(np.random.default_rng(index).normal(0, 0.1, (2, count)), -1, 1).astype(np.float32)
    raise ValueError(f"sound kind must be one of {SOUNDS[:-1]}, got {kind!r}")


def with_sound(video: bytes, kind: str, index: int = 0) -> bytes:
    """The mp4 piece with a sound track of `kind` (`sound_wave`) as long as its video, AAC beside the frames
    (the video stream copied, not re-encoded); `none` returns it unchanged."""
    if kind == "none":
        return video
    out = io.BytesIO()
    with av.open(io.BytesIO(video)) as source, av.open(out, mode="w", format="mp4") as target:
        stream = source.streams.video[0]
        seconds = (
            float(stream.duration * stream.time_base) if stream.duration else float(source.duration) / av.time_base
        )
        copy = target.add_stream_from_template(stream)
        audio = target.add_stream("aac", rate=SOUND_RATE, layout="stereo")
        for packet in source.demux(stream):
            if packet.dts is None:  # the demuxer's empty flush packet
                continue
            packet.stream = copy
            target.mux(packet)
        frame = av.AudioFrame.from_ndarray(sound_wave(kind, seconds, index), format="fltp", layout="stereo")
        frame.sample_rate, frame.pts = SOUND_RATE, 0
        target.mux(audio.encode(frame))
        target.mux(audio.encode(None))
    return out.getvalue()


def control_video(video: bytes, kind: str = "edges") -> bytes:
    """A control video of an mp4 piece: each frame as its edge map (Sobel gradient magnitude of the luma,
    white edges on black) or its grayscale, same size, frame rate and timing, as h264 mp4 bytes."""
    if kind not in CONTROLS:
        raise ValueError(f"control kind must be one of {CONTROLS}, got {kind!r}")
    with av.open(io.BytesIO(video)) as source:
        stream = source.streams.video[0]
        rate, size = stream.average_rate or Fraction(25), (stream.codec_context.height, stream.codec_context.width)
        writer = _PieceWriter(rate, *size)
        for frame in source.decode(stream):
            luma = frame.to_ndarray(format="gray").astype(np.float32)
            if kind == "edges":
                padded = np.pad(luma, 1, mode="edge")
                gx = (
                    padded[:-2, 2:]
                    + 2 * padded[1:-1, 2:]
                    + padded[2:, 2:]
                    - padded[:-2, :-2]
                    - 2 * padded[1:-1, :-2]
                    - padded[2:, :-2]
                )
                gy = (
                    padded[2:, :-2]
                    + 2 * padded[2:, 1:-1]
                    + padded[2:, 2:]
                    - padded[:-2, :-2]
                    - 2 * padded[:-2, 1:-1]
                    - padded[:-2, 2:]
                )
                luma = np.hypot(gx, gy) / 4
            gray = np.clip(luma, 0, 255).astype(np.uint8)
            rgb = np.ascontiguousarray(np.repeat(gray[..., None], 3, axis=2))
            writer.add(av.VideoFrame.from_ndarray(rgb, format="rgb24").reformat(format="yuv420p"))
    return writer.close()


def _add(tar: tarfile.TarFile, name: str, data: bytes) -> None:
    info = tarfile.TarInfo(name)
    info.size, info.mtime, info.mode = len(data), 0, 0o644
    tar.addfile(info, io.BytesIO(data))


def make_sample_shards(
    clips: list[Path],
    out: Path,
    seconds: float = 1.5,
    per_shard: int = 8,
    max_side: int = 480,
    captions: dict[str, str] | None = None,
    caption_format: str = "txt",
    interleave: bool = False,
    control: str | None = None,
    sound: str = "none",
) -> list[Path]:
    """Write raw shards out/raw-000000.tar ... and return their paths.

    `captions` maps a clip's file stem to its caption (defaults cover the four sample clips);
    `caption_format` "txt" writes <key>.txt, "json" writes <key>.json {"caption": ...};
    `interleave` takes the clips' pieces round-robin (as a crawl mixes sources) instead of clip by clip;
    `control` ("edges" or "gray") also writes each piece's control video as <key>.control.mp4;
    `sound` ("tone" or "noise") muxes a sound track into every piece (`with_sound`).
    """
    if caption_format not in ("txt", "json"):
        raise ValueError(f"caption_format must be 'txt' or 'json', got {caption_format!r}")
    if seconds <= 0 or per_shard < 1 or max_side < 2:
        raise ValueError("need seconds > 0, per_shard >= 1 and max_side >= 2")
    known = {**CAPTIONS, **(captions or {})}
    per_clip: list[list[tuple[str, bytes, str]]] = []
    for clip in sorted(Path(c) for c in clips):
        caption = known.get(clip.stem)
        if caption is None:
            raise ValueError(f"no caption for clip {clip.name}; pass captions={{'{clip.stem}': '...'}}")
        per_clip.append(
            [
                (f"{clip.stem}-{number:03d}", with_sound(video, sound, len(per_clip) + number), caption)
                for number, video in enumerate(cut_clip(clip, seconds, max_side))
            ]
        )
    if interleave:
        rounds = itertools.zip_longest(*per_clip)
        samples = [sample for one_round in rounds for sample in one_round if sample is not None]
    else:
        samples = [sample for pieces in per_clip for sample in pieces]
    if not samples:
        raise ValueError(f"no clip is at least {seconds}s long: {[str(c) for c in clips]}")
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    shards = []
    for first in range(0, len(samples), per_shard):
        path = out / f"raw-{first // per_shard:06d}.tar"
        partial = path.with_name(path.name + ".part")
        with tarfile.open(partial, "w", format=tarfile.USTAR_FORMAT) as tar:
            for key, video, caption in samples[first : first + per_shard]:
                _add(tar, f"{key}.mp4", video)
                if control:
                    _add(tar, f"{key}.control.mp4", control_video(video, control))
                text = caption if caption_format == "txt" else json.dumps({"caption": caption})
                _add(tar, f"{key}.{caption_format}", text.encode("utf-8"))
        partial.replace(path)
        shards.append(path)
    return shards


STILL_FORMATS = (("jpg", "JPEG"), ("png", "PNG"), ("webp", "WEBP"))


def cut_stills(clip: Path, count: int, max_side: int, start: int = 0) -> list[tuple[str, bytes]]:
    """`count` frames spread over the clip as (extension, image bytes), cycling through .jpg, .png and
    .webp from format `start`."""
    from PIL import Image

    with av.open(str(clip)) as source:
        total = source.streams.video[0].frames or sum(1 for _ in source.decode(video=0))
    wanted = {(2 * i + 1) * total // (2 * count) for i in range(count)}
    with av.open(str(clip)) as source:
        picks = [frame for n, frame in zip(range(max(wanted) + 1), source.decode(video=0)) if n in wanted]
    stills = []
    for index, frame in enumerate(picks):
        height, width = _output_size(frame.height, frame.width, max_side)
        image = Image.fromarray(frame.to_ndarray(format="rgb24")).resize((width, height), Image.Resampling.BOX)
        buffer = io.BytesIO()
        ext, kind = STILL_FORMATS[(start + index) % len(STILL_FORMATS)]
        image.save(buffer, kind)
        stills.append((ext, buffer.getvalue()))
    return stills


def make_media_folder(
    clips: list[Path],
    out: Path,
    seconds: float = 1.5,
    max_side: int = 256,
    stills_per_clip: int = 3,
    pieces_per_clip: int | None = None,
    control: str | None = None,
    sound: str = "none",
) -> list[Path]:
    """A raw folder as the peers take it: `<clip>-<n>.mp4` pieces (at most `pieces_per_clip`) and
    `<clip>-still-<n>.jpg` / `.png` / `.webp` cut from the clips, each with a `.txt` caption (the
    clip's, plus "a still of" for images); returns the media files. `control` ("edges" or "gray") also
    writes each piece's control video beside it, `<clip>-<n>.control.mp4`; `sound` ("tone" or "noise") muxes a
    sound track into every piece (`with_sound`)."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    written, stills = [], 0
    for clip in sorted(Path(c) for c in clips):
        caption = CAPTIONS.get(clip.stem)
        if caption is None:
            raise ValueError(f"no caption for clip {clip.name}; add it to CAPTIONS")
        media = [
            (f"{clip.stem}-{n:03d}.mp4", with_sound(video, sound, len(written) + n), caption)
            for n, video in enumerate(cut_clip(clip, seconds, max_side)[:pieces_per_clip])
        ]
        media += [
            (f"{clip.stem}-still-{n:03d}.{ext}", image, f"a still of {caption}")
            for n, (ext, image) in enumerate(cut_stills(clip, stills_per_clip, max_side, start=stills))
        ]
        stills += stills_per_clip
        for name, data, text in media:
            (out / name).write_bytes(data)
            (out / name).with_suffix(".txt").write_text(text)
            if control and name.endswith(".mp4"):
                (out / name).with_suffix(".control.mp4").write_bytes(control_video(data, control))
            written.append(out / name)
    return written


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--clips", type=Path, required=True, help="folder of .mp4 clips")
    parser.add_argument("--out", type=Path, required=True, help="folder for raw-*.tar")
    parser.add_argument("--seconds", type=float, default=1.5)
    parser.add_argument("--per-shard", type=int, default=8)
    parser.add_argument("--max-side", type=int, default=480)
    parser.add_argument("--json", action="store_true", help="captions as <key>.json instead of <key>.txt")
    parser.add_argument(
        "--stills",
        type=int,
        default=0,
        help="write a media folder instead of tars: the pieces plus this many stills per clip",
    )
    parser.add_argument(
        "--control",
        choices=CONTROLS,
        default=None,
        help="also write each piece's control video (<key>.control.mp4): its edges or its grayscale",
    )
    parser.add_argument(
        "--sound",
        choices=SOUNDS,
        default="none",
        help="mux a sound track into every piece (a tone or noise, 44.1 kHz stereo AAC); default none",
    )
    args = parser.parse_args(argv)
    clips = sorted(args.clips.glob("*.mp4"))
    if not clips:
        raise SystemExit(
            f"no .mp4 clips in {args.clips}; fetch some: python scripts/fetch_sample_clips.py {args.clips}"
        )
    if args.stills:
        written = make_media_folder(
            clips,
            args.out,
            args.seconds,
            args.max_side,
            stills_per_clip=args.stills,
            control=args.control,
            sound=args.sound,
        )
    else:
        written = make_sample_shards(
            clips,
            args.out,
            args.seconds,
            args.per_shard,
            args.max_side,
            caption_format="json" if args.json else "txt",
            control=args.control,
            sound=args.sound,
        )
    for path in written:
        print(path)


if __name__ == "__main__":
    main()
