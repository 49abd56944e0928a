import pytest

from vt.shared.buckets import Bucket, buckets_for, choose_bucket, crop_box, parse_buckets, resize_for_crop

BUCKETS = parse_buckets(["9x64x96", "9x64x64", "9x96x64", "17x64x96"])


def test_parse_and_name():
    assert Bucket.parse("17x64x96") == Bucket(17, 64, 96)
    assert Bucket(9, 64, 96).name == "9x64x96"
    with pytest.raises(ValueError, match="FRAMESxHEIGHTxWIDTH"):
        Bucket.parse("9x64")
    with pytest.raises(ValueError, match="at least one bucket"):
        parse_buckets([])


@pytest.mark.parametrize(
    "frames, height, width, expected",
    [
        (40, 720, 1280, Bucket(17, 64, 96)),  # landscape, long enough for 17 frames
        (10, 720, 1280, Bucket(9, 64, 96)),  # landscape, only 9 frames
        (40, 1280, 720, Bucket(9, 96, 64)),  # portrait: nearest aspect wins over more frames
        (40, 500, 500, Bucket(9, 64, 64)),
    ],
)
def test_choose_nearest_aspect_then_most_frames(frames, height, width, expected):
    assert choose_bucket(BUCKETS, frames, height, width) == expected


def test_too_short_clip_has_no_bucket():
    assert choose_bucket(BUCKETS, 8, 720, 1280) is None


def test_resize_covers_bucket_without_stretching():
    bucket = Bucket(9, 64, 96)
    height, width = resize_for_crop(720, 1280, bucket)
    assert height == 64 and width >= 96
    assert abs(width / height - 1280 / 720) < 0.02
    top, left = crop_box(height, width, bucket)
    assert top == 0 and left == (width - 96) // 2


def test_stills_take_one_frame_buckets_and_families_refuse_them_where_they_cannot_train(
    tiny_model_factory, monkeypatch
):
    from vt.shared.config import ModelConfig
    from vt.shared.models import build_spec

    table = parse_buckets(["9x64x96", "1x64x96", "1x64x64"])
    assert buckets_for(table, still=True) == [Bucket(1, 64, 64), Bucket(1, 64, 96)]
    assert buckets_for(table, still=False) == [Bucket(9, 64, 96)]

    path = str(tiny_model_factory("ltx-video"))
    t2v = build_spec(ModelConfig(family="ltx-video", path=path), 8.0)
    t2v.check_bucket(Bucket(1, 64, 96))  # most families train on images as one-frame buckets
    with pytest.raises(ValueError, match="i2v conditions on the first frame"):
        build_spec(ModelConfig(family="ltx-video", task="i2v", path=path), 8.0).check_bucket(Bucket(1, 64, 96))
    monkeypatch.setattr(type(t2v), "single_frame", False)  # a family whose VAE cannot take one frame
    with pytest.raises(ValueError, match="cannot take one-frame buckets.*remove 1xHxW"):
        t2v.check_bucket(Bucket(1, 64, 96))
