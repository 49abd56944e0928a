"""write_video/read_video round trips through real h264 files."""

from __future__ import annotations

import av
import numpy as np
import pytest

from vt.shared.video_io import Sound, read_sound, read_video, write_video


def _moving_gradient(frames: int, height: int, width: int) -> np.ndarray:
    """Smooth content that h264 keeps well: color ramps that shift a little each frame."""
    y = np.linspace(0, 1, height)[:, None]
    x = np.linspace(0, 1, width)[None, :]
    out = np.empty((frames, height, width, 3), dtype=np.uint8)
    for f in range(frames):
        shift = f / frames
        out[f, ..., 0] = 255 * ((x + shift) % 1.0) * np.ones_like(y)
        out[f, ..., 1] = 255 * y * np.ones_like(x)
        out[f, ..., 2] = 255 * (1 - 0.5 * (x + y)) * (1 - 0.5 * shift)
    return out


def test_round_trip_keeps_frames_size_and_pixels(tmp_path):
    frames = _moving_gradient(9, 64, 96)
    path = write_video(frames, tmp_path / "deep" / "folder" / "clip.mp4", fps=8.0)
    assert path == tmp_path / "deep" / "folder" / "clip.mp4"
    assert [p.name for p in path.parent.iterdir()] == ["clip.mp4"]  # no temp file left behind
    back = read_video(path)
    assert back.shape == (9, 64, 96, 3) and back.dtype == np.uint8
    error = np.abs(back.astype(np.int16) - frames.astype(np.int16)).mean()
    assert error < 4.0, f"mean abs pixel error {error:.2f} is too high for crf 18"
    with av.open(str(path)) as container:
        stream = container.streams.video[0]
        assert stream.codec_context.name == "h264"
        assert stream.codec_context.pix_fmt == "yuv420p"
        assert float(stream.average_rate) == pytest.approx(8.0)


def test_odd_sizes_are_padded_to_even(tmp_path):
    frames = _moving_gradient(3, 33, 47)
    back = read_video(write_video(frames, tmp_path / "odd.mp4", fps=24))
    assert back.shape == (3, 34, 48, 3)
    error = np.abs(back[:, :33, :47].astype(np.int16) - frames.astype(np.int16)).mean()
    assert error < 6.0  # small frames with a hard wrap-around edge: a little worse than above
    # The padding repeats the last row and column, so it looks like its neighbours.
    pad_error = np.abs(back[:, 33, :47].astype(np.int16) - frames[:, 32].astype(np.int16)).mean()
    assert pad_error < 8.0


def test_fractional_fps_and_single_frame(tmp_path):
    frame = np.full((1, 16, 16, 3), 200, dtype=np.uint8)
    path = write_video(frame, tmp_path / "one.mp4", fps=29.97)
    back = read_video(path)
    assert back.shape == (1, 16, 16, 3)
    assert abs(int(back.mean()) - 200) <= 2
    with av.open(str(path)) as container:
        assert float(container.streams.video[0].average_rate) == pytest.approx(29.97, abs=0.01)


@pytest.mark.parametrize(
    "frames, message",
    [
        (np.zeros((4, 8, 8), dtype=np.uint8), r"\(F, H, W, 3\)"),
        (np.zeros((4, 8, 8, 4), dtype=np.uint8), r"\(F, H, W, 3\)"),
        (np.zeros((0, 8, 8, 3), dtype=np.uint8), r"F, H, W >= 1"),
        (np.zeros((2, 8, 8, 3), dtype=np.float32), r"astype\(np.uint8\)"),
    ],
)
def test_bad_frames_are_rejected_with_a_fix(tmp_path, frames, message):
    with pytest.raises(ValueError, match=message):
        write_video(frames, tmp_path / "bad.mp4")
    assert not (tmp_path / "bad.mp4").exists()


def test_read_missing_or_broken_file(tmp_path):
    with pytest.raises(FileNotFoundError, match="no video"):
        read_video(tmp_path / "missing.mp4")
    broken = tmp_path / "broken.mp4"
    broken.write_bytes(b"not a video at all")
    with pytest.raises((av.error.InvalidDataError, ValueError)):
        read_video(broken)


@pytest.mark.parametrize("channels", [1, 2])
def test_a_sound_track_is_muxed_beside_the_frames(tmp_path, channels):
    rate = 16000
    time = np.arange(rate) / rate
    tones = np.stack([np.sin(2 * np.pi * 220 * time), np.sin(2 * np.pi * 330 * time)])[:channels] * 0.5
    path = write_video(
        _moving_gradient(8, 32, 32), tmp_path / "clip.mp4", fps=8, sound=Sound(tones.astype(np.float32), rate)
    )
    assert read_video(path).shape == (8, 32, 32, 3)
    sound = read_sound(path)
    assert sound.sample_rate == rate and sound.waveform.shape[0] == channels
    assert sound.waveform.shape[1] >= rate  # AAC pads to whole frames, never cuts
    for heard, played in zip(sound.waveform, tones):
        assert np.corrcoef(heard[:8000], played[:8000])[0, 1] > 0.98  # the same tone, not noise or silence
    assert read_sound(write_video(_moving_gradient(8, 32, 32), tmp_path / "silent.mp4")) is None
