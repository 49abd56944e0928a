"""Stage 1 as a real Slurm job array (scripts/slurm/precompute_array.sbatch), stopped and resubmitted.

A one-node Slurm 22.05 on 127.0.0.1 (tests/helpers/slurm_cluster.py). The real clips' samples in 2-sample raw shards
(at least 6), a rolling window of 6 latent shards, one epoch. An array of 3 starts: the lane count becomes
3 (lanes.json). Once a lane has committed, its element is scancelled (SIGTERM: it releases its lane); as no
trainer reads yet, the window fills, so the rest of the array is cancelled too, as a time limit would. Then an
array of 2 is submitted and the trainer started: both elements end COMPLETED, the lane count is still 3,
at least two elements committed samples, and the trainer's epoch holds every sample of the raw shards
exactly once, as an undisturbed single producer's run would.
"""

from __future__ import annotations

import io
import json
import subprocess
import tarfile
import time
from collections import Counter
from pathlib import Path

import pytest
from typer.testing import CliRunner

from vt.precompute.cli import app
from vt.shared.claims import look
from vt.shared.storage import Storage

from helpers.cli_runs import BIN, finish, raw_keys, start, write_config
from helpers.slurm_cluster import slurm  # noqa: F401 - the fixture

pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("clusters")]

ROOT = Path(__file__).resolve().parents[2]
SBATCH = ROOT / "scripts" / "slurm" / "precompute_array.sbatch"
TRAIN_SBATCH = ROOT / "scripts" / "slurm" / "train_multinode.sbatch"
SHARE = 2  # each lane's share of the window: 6 shards over 3 lanes


@pytest.fixture(scope="module")
def small_shards(raw_shards, tmp_path_factory) -> Path:
    """The samples of `raw_shards` (the real clips' pieces) repacked two per tar: at least 6 raw shards."""
    members: dict[str, list[tuple[tarfile.TarInfo, bytes]]] = {}
    order: list[str] = []
    for tar_path in sorted(raw_shards.glob("*.tar")):
        with tarfile.open(tar_path) as tar:
            for info in tar.getmembers():
                key = info.name.split(".", 1)[0]
                if key not in members:
                    order.append(key)
                    members[key] = []
                members[key].append((info, tar.extractfile(info).read()))
    out = tmp_path_factory.mktemp("raw-small")
    for first in range(0, len(order), 2):
        with tarfile.open(out / f"raw-{first // 2:06d}.tar", "w", format=tarfile.USTAR_FORMAT) as tar:
            for key in order[first : first + 2]:
                for info, data in members[key]:
                    tar.addfile(info, io.BytesIO(data))
    assert len(list(out.glob("*.tar"))) >= 6
    return out


def committed_lanes(window: Storage) -> set[int]:
    """The lanes with at least one commit record (commits/p<lane>/<seq>.json)."""
    return {int(rel.split("/")[1][1:]) for rel in window.list("commits")}


def held_lanes(window: Storage, lanes: int = 3) -> set[int]:
    """The lanes whose newest lease is neither released nor done: what producers see as held (shared/claims.py)."""
    return {
        lane
        for lane, seen in look(window, lanes).items()
        if seen.generation is not None and not seen.released and not seen.done
    }


def lane_status(window_dir: Path) -> dict[int, dict]:
    """`vt-precompute status WINDOW --json`'s lanes: {lane: {"state": "held"/"waiting"/"done", "holder", ...}}."""
    out = CliRunner().invoke(app, ["status", str(window_dir), "--json"])
    assert out.exit_code == 0, out.output
    return {int(lane): info for lane, info in json.loads(out.output)["by_lane"].items()}


def reports(run_dir: Path) -> dict[str, dict]:
    return {path.name: json.loads(path.read_text()) for path in sorted(run_dir.glob("precompute_report.task*.json"))}


def element_logs(tmp_path: Path, job: str) -> str:
    return "\n".join(
        f"--- {p.name} ---\n{p.read_text(errors='replace')[-2500:]}"
        for p in sorted(tmp_path.glob(f"slurm-{job}_*.out"))
    )


def window_story(window: Storage) -> str:
    """The window's files (leases, commits, done markers, producer records) and the trainer's read positions."""
    files = "\n".join(f"{rel} {stamp}" for rel, stamp in sorted(window.stamps("").items()) if "/" in rel)
    records = {
        rel: window.read(rel).decode(errors="replace")
        for rel in sorted(window.list("producers")) + sorted(window.list("workers")) + ["consumer.json"]
        if window.exists(rel)
    }
    return f"--- window files ---\n{files}\n" + "\n".join(f"--- {rel} ---\n{text}" for rel, text in records.items())


def test_array_scancelled_and_resubmitted_trains_every_sample_once(
    tmp_path,
    slurm,  # noqa: F811 - the fixture
    tiny_model_factory,
    small_shards,
):
    started = time.monotonic()
    run_dir, window_dir = tmp_path / "run", tmp_path / "run" / "window"
    config = write_config(
        tmp_path / "run.toml",
        tiny_model_factory("ltx-video"),
        small_shards,
        run_dir,
        str(window_dir),
        window={"size": 6, "poll_seconds": 0.05, "timeout_seconds": 120.0},
        precompute={"workers": 0, "claim_seconds": 10.0},
        train={"epochs": 1, "batch_size": 2},
        log={"samples": True, "progress": False},
    )
    window = Storage(str(window_dir))
    slurm.env.update(
        {
            "PATH": f"{BIN}:{slurm.env['PATH']}",
            "HF_HUB_OFFLINE": "1",
            "OMP_NUM_THREADS": "1",
            "TOKENIZERS_PARALLELISM": "false",
        }
    )

    def submit(array: str) -> str:
        return slurm.sbatch(
            f"--array={array}",
            "--gres=none",
            "--cpus-per-task=1",
            f"--chdir={tmp_path}",
            f"--output={tmp_path}/slurm-%A_%a.out",
            str(SBATCH),
            str(config),
        )

    first = submit("0-2")
    # An element that committed: the holder of a held lane with a commit record (`task<i>` in vt-precompute status).
    victim = slurm.wait(
        lambda: (
            (lanes := committed_lanes(window) & held_lanes(window)) and lane_status(window_dir)[min(lanes)]["holder"]
        ),
        timeout=240,
        what=lambda: f"a commit of array {first}\n{element_logs(tmp_path, first)}",
    )
    task = int(victim.removeprefix("task"))
    assert slurm.queue(first).get(str(task)) == "RUNNING", slurm.queue(first)
    slurm.scancel(f"{first}_{task}")
    ended = slurm.wait_finished(first, [task], timeout=60)[task]
    assert ended["JobState"] == "CANCELLED", ended
    # No trainer reads yet: the other elements fill the window (the cancelled lane taken over) and wait for room;
    # stop them then, as a time limit would.
    slurm.wait(
        lambda: all(
            len(window.list(f"commits/p{lane}")) >= SHARE or seen.done for lane, seen in look(window, 3).items()
        ),
        timeout=180,
        what=lambda: f"a full window\n{element_logs(tmp_path, first)}",
    )
    slurm.scancel(first)
    slurm.wait_gone(first, timeout=60)
    first_reports = reports(run_dir)
    first_logs = element_logs(tmp_path, first)
    assert f"precompute_report.task{task}.json" in first_reports, ("no report of the cancelled element", first_logs)
    victim_report = first_reports[f"precompute_report.task{task}.json"]
    assert victim_report["committed"] > 0 and "SystemExit" in victim_report["status"], (victim_report, first_logs)
    # SIGTERM released every lane the array held: none is left held by a stopped producer.
    assert not held_lanes(window), (
        "lanes left held by stopped producers (not released on SIGTERM)",
        held_lanes(window),
        sorted(window.list("leases")),
        first_logs,
    )
    assert json.loads(window.read("lanes.json"))["lanes"] == 3

    second = submit("0-1")
    trainer = start("train", config, log=tmp_path / "train.log")
    try:
        done = slurm.wait_finished(second, [0, 1], timeout=240)
        try:
            finish(trainer, tmp_path / "train.log", timeout=120)
        except AssertionError as err:  # what the second array did meanwhile says why the trainer waited
            raise AssertionError(f"{err}\n{done}\n{element_logs(tmp_path, second)}\n{window_story(window)}") from None
    finally:
        if trainer.poll() is None:
            trainer.kill()
            trainer.wait()
    assert {t: r["JobState"] for t, r in done.items()} == {0: "COMPLETED", 1: "COMPLETED"}, element_logs(
        tmp_path, second
    )
    assert json.loads(window.read("lanes.json"))["lanes"] == 3

    second_reports = reports(run_dir)
    committed = {f"{first}_{r['producer']}": r["committed"] for r in first_reports.values()}
    committed |= {f"{second}_task{t}": second_reports[f"precompute_report.task{t}.json"]["committed"] for t in (0, 1)}
    assert sum(1 for n in committed.values() if n > 0) >= 2, committed
    # Every element that committed wrote its report, a SIGTERMed one too (a cancelled shard may be encoded again).
    assert sum(committed.values()) >= len(raw_keys(small_shards)), (committed, first_logs)

    entries = [json.loads(line) for line in (run_dir / "samples.jsonl").read_text().splitlines()]
    seen = Counter(key for entry in entries for key in entry["keys"])
    assert set(seen) == raw_keys(small_shards)
    assert set(seen.values()) == {1}, {k: n for k, n in seen.items() if n != 1}

    lanes = lane_status(window_dir)
    assert len(lanes) == 3 and {info["state"] for info in lanes.values()} == {"done"}, lanes
    print(f"slurm test: {time.monotonic() - started:.1f}s; committed per element {committed}")


def test_sbatch_scripts_parse():
    """Both scripts are valid bash (the multi-node trainer is checked no further: one node here)."""
    for script in (SBATCH, TRAIN_SBATCH):
        done = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True, timeout=30)
        assert done.returncode == 0, (script.name, done.stderr)
