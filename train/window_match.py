"""Which shards a trainer takes, decided without reading a byte of an encoder it does not load.

Stage 1 names every shard by the fingerprint of its provenance (vt.shared.provenance): the settings both
stages share, and a digest of each encoder's files (tokenizers, text and image encoders, the VAE). A
trainer loads none of the text encoders (stage 1 stores the validation prompts' conditions too) and the
VAE only to decode validation videos, so it does not recompute that fingerprint: with a hub id as
model.path that would download tens of GB per node for nothing, and it could not start where only what
it loads is on disk. Instead, at the first shard it reads the shard's own provenance and takes its
fingerprint as the run's when:

- every setting but the weights equals the trainer's own (family, task, text length, dtypes, frame rate,
  buckets, processor chain, audio ...);
- the shard names the same encoders as the config's family and task;
- each encoder the trainer loads (the VAE and audio decoders when it validates) has the recorded digest;
- each one it does not load matches what stage 1 recorded of it beside the provenance (`meta["sources"]`):
  by its files' names and sizes (a stat each, no read) where the config's folder for it is on this disk,
  else by name: the same folder or hub id as stage 1 read it from. A shard of a vt older than that
  record carries none: its unloaded encoders are taken as it names them.

Every later shard must carry that same fingerprint. A refusal names each difference and what to do.
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable

from vt.shared.chain import captioner_options
from vt.shared.log import get_logger
from vt.shared.provenance import (
    CAPTIONER,
    describe_difference,
    fingerprint,
    folder_digest,
    folder_files,
    local_folder,
    provenance,
)
from vt.shared.shards import CommitRecord
from vt.train.data import StaleShardError

log = get_logger("vt.train")


class WindowMatch:
    """`check(record, read_meta)` for the batch reader; `fingerprint` once a shard was taken (validation
    conditions and the empty caption are stored under it), kept in checkpoints (`state_dict`).

    Distributed, rank 0 decides and broadcasts its verdict: `check` and `load_state_dict` are called on
    every rank at the same records (the reader plans in lock-step), so no other rank reads a shard's header
    for it, and rank 0 reads it through the reader's own header cache (`read_meta`)."""

    def __init__(self, config, spec, world, loads: set[str]):
        self.config, self.spec, self.world = config, spec, world
        self.loads = loads  # the stage-1 components this run loads (checked by digest)
        self.settings = provenance(config, weights={}, spec=spec)
        self.captioner = captioner_options(config.precompute.processors)  # caption_model's, if the chain has one
        self._taken: dict = {}  # {"fingerprint", "provenance", "sources"} of the shards this run takes

    @property
    def fingerprint(self) -> str:
        if not self._taken:
            raise RuntimeError("no shard was read yet: the window's fingerprint is taken from its first shard")
        return self._taken["fingerprint"]

    def check(self, record: CommitRecord, read_meta: Callable[[CommitRecord], dict]) -> None:
        if self._taken and record.fingerprint == self._taken["fingerprint"]:
            return
        verdict = None
        if self.world.is_main:
            meta = read_meta(record)
            found = {
                "fingerprint": record.fingerprint,
                "provenance": meta.get("provenance", {}),
                "sources": meta.get("sources"),
            }
            verdict = self._verdict(found, f"shard {record.data}")
        self._apply(self.world.broadcast_object(verdict))

    def state_dict(self) -> dict:
        return dict(self._taken)

    def load_state_dict(self, state: dict) -> None:
        """A resumed run takes the checkpoint's shards again, checked against this (maybe changed) config."""
        if state:
            self._apply(
                self.world.broadcast_object(
                    self._verdict(state, "the checkpoint's shards") if self.world.is_main else None
                )
            )

    def _verdict(self, found: dict, what: str) -> dict:
        """{"refused": message} or the shards taken, with the encoders not on this disk (rank 0)."""
        prov = found["provenance"]
        if self._taken:  # a second fingerprint in one window: its shards were made otherwise
            problems = [describe_difference(self._taken["provenance"], prov)]
        else:
            unseen: list[str] = []
            problems = self._differences(prov, found["sources"], unseen)
            if fingerprint(prov) != found["fingerprint"]:
                problems.append("its provenance does not give the fingerprint its commit record names (edited?)")
        if problems:
            return {
                "refused": f"{what} was made with other settings than this config ({'; '.join(problems)}). "
                "Re-run vt-precompute into a fresh window (window.uri) or point the trainer at a "
                "config that matches."
            }
        checked = sorted(self.loads & set(prov["weights"]))
        log.info(
            "window shards %s taken; encoders checked by digest: %s; not on this disk, as stage 1 recorded them: %s",
            found["fingerprint"],
            ", ".join(checked) or "none (none loaded)",
            "; ".join(unseen) or "none",
        )
        return found

    def _apply(self, verdict: dict) -> None:
        if "refused" in verdict:
            raise StaleShardError(verdict["refused"])
        self._taken = verdict

    def _differences(self, found: dict, sources: dict | None, unseen: list[str]) -> list[str]:
        recorded = found.get("weights", {})
        problems = (
            [describe_difference(self.settings, {**found, "weights": {}})]
            if {**found, "weights": {}} != self.settings
            else []
        )
        wanted = set(self.spec.stage1_components) | ({CAPTIONER} if self.captioner else set())
        if set(recorded) != wanted:
            return problems + [f"weights: shard has encoders {sorted(recorded)}, config wants {sorted(wanted)}"]
        for name in sorted(wanted):
            if name in self.loads:
                ours = folder_digest(local_folder(self.spec, name))  # where loading reads it
                if ours != recorded[name]:
                    problems.append(f"weights.{name}: shard has {recorded[name]!r}, config wants {ours!r}")
            elif sources is not None:
                problems += self._identity(name, sources.get(name, {}), unseen)
        return problems

    def _identity(self, name: str, source: dict, unseen: list[str]) -> list[str]:
        """An encoder this run does not load, against stage 1's record of it: a difference only where this disk
        shows one (its files' names and sizes; a stat each). Absent, it is taken as recorded (logged)."""
        here = self._on_disk(name, source.get("revision"))
        if here is None:
            revision = f", revision {source['revision']}" if "revision" in source else ""
            unseen.append(f"{name} (from {source.get('source')!r}{revision})")
            return []
        ours, theirs = folder_files(here), source.get("files", {})
        if ours == theirs:
            return []
        key = f"model.components.{name}" if name in self.config.model.components else "model.path"
        key = "caption_model's model (precompute.processors)" if name == CAPTIONER else key
        changed = sorted(set(ours) ^ set(theirs) | {f for f in set(ours) & set(theirs) if ours[f] != theirs[f]})
        return [
            f"weights.{name}: {here} holds other files than stage 1 read from {source.get('source')!r} "
            f"({', '.join(changed[:4])} differ in name or size); point {key} at the {name} stage 1 used"
        ]

    def _on_disk(self, name: str, revision: str | None) -> Path | None:
        """A component's folder where the config names it, if it is on this disk: a local folder, or a hub id's
        snapshot already in the local cache (never downloaded); None if it is not here."""
        override = self.captioner.model if name == CAPTIONER else self.config.model.components.get(name)
        path, subfolder = (override, None) if override else (self.config.model.path, name)
        if Path(path).exists():
            folder = Path(path) / subfolder if subfolder else Path(path)
            return folder if folder.is_dir() else None
        from huggingface_hub import snapshot_download

        try:  # local_files_only: a cached snapshot or nothing, no request
            root = Path(snapshot_download(path, revision=revision, local_files_only=True))
        except (OSError, ValueError):  # not in the cache, or not a hub id
            return None
        folder = root / subfolder if subfolder else root
        return folder if folder.is_dir() else None
