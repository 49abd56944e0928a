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

from vt.shared.log import get_logger
from vt.shared.provenance import (
    describe_difference,
    fingerprint,
    folder_digest,
    folder_files,
    local_folder,
    provenance,
)
from vt.shared.shards import CommitRecord
from vt.shared.window import Window
from vt.train.data import StaleShardError

log = get_logger("vt.train")


class WindowMatch:
    """`check(record)` for the batch reader; `fingerprint` once a shard was taken (validation conditions
    and the empty caption are stored under it)."""

    def __init__(self, config, spec, window: Window, loads: set[str]):
        self.config, self.spec, self.window = config, spec, window
        self.loads = loads  # the stage-1 components this run loads (checked by digest)
        self.settings = provenance(config, weights={}, spec=spec)
        self._fingerprint: str | None = None
        self._taken: dict | None = None
        self.unseen: list[str] = []  # encoders not loaded and not on this disk: taken as stage 1 recorded them

    @property
    def fingerprint(self) -> str:
        if self._fingerprint is None:
            raise RuntimeError("no shard was read yet: the window's fingerprint is taken from its first shard")
        return self._fingerprint

    def check(self, record: CommitRecord) -> None:
        if record.fingerprint == self._fingerprint:
            return
        meta = self.window.shard_meta(record)
        found = meta.get("provenance", {})
        if self._taken is not None:  # a second fingerprint in one window: its shards were made otherwise
            self._refuse(record, describe_difference(self._taken, found))
        problems = self._differences(found, meta.get("sources"))
        if problems:
            self._refuse(record, "; ".join(problems))
        if fingerprint(found) != record.fingerprint:
            self._refuse(record, "its provenance does not give the fingerprint its commit record names (edited by hand?)")
        self._fingerprint, self._taken = record.fingerprint, found
        checked = sorted(self.loads & set(found["weights"]))
        log.info("window shards %s taken; encoders checked by digest: %s; not on this disk, as stage 1 recorded "
                 "them: %s", record.fingerprint, ", ".join(checked) or "none (none loaded)", "; ".join(self.unseen) or "none")

    def _refuse(self, record: CommitRecord, why: str) -> None:
        raise StaleShardError(
            f"shard {record.data} was made with other settings than this config ({why}). Re-run vt-precompute "
            f"into a fresh window (window.uri) or point the trainer at a config that matches.")

    def _differences(self, found: dict, sources: dict | None) -> list[str]:
        recorded = found.get("weights", {})
        problems = [describe_difference(self.settings, {**found, "weights": {}})] \
            if {**found, "weights": {}} != self.settings else []
        wanted = set(self.spec.stage1_components)
        if set(recorded) != wanted:
            return problems + [f"weights: shard has encoders {sorted(recorded)}, config wants {sorted(wanted)}"]
        for name in sorted(wanted):
            if name in self.loads:
                ours = folder_digest(self._folder(name))
                if ours != recorded[name]:
                    problems.append(f"weights.{name}: shard has {recorded[name]!r}, config wants {ours!r}")
            elif sources is not None:
                problems += self._identity(name, sources.get(name, {}))
        return problems

    def _identity(self, name: str, source: dict) -> list[str]:
        """An encoder this run does not load, against stage 1's record of it: a difference only where this disk
        shows one (its files' names and sizes; a stat each). Absent, it is taken as recorded (logged)."""
        here = self._on_disk(name, source.get("revision"))
        if here is None:
            revision = f", revision {source['revision']}" if "revision" in source else ""
            self.unseen.append(f"{name} (from {source.get('source')!r}{revision})")
            return []
        ours, theirs = folder_files(here), source.get("files", {})
        if ours == theirs:
            return []
        key = f"model.components.{name}" if name in self.config.model.components else "model.path"
        changed = sorted(set(ours) ^ set(theirs) | {f for f in set(ours) & set(theirs) if ours[f] != theirs[f]})
        return [f"weights.{name}: {here} holds other files than stage 1 read from {source.get('source')!r} "
                f"({', '.join(changed[:4])} differ in name or size); point {key} at the {name} stage 1 used"]

    def _on_disk(self, name: str, revision: str | None) -> Path | None:
        """A component's folder where the config names it, if it is on this disk: a local folder, or a hub id's
        snapshot already in the local cache (never downloaded); None if it is not here."""
        override = self.config.model.components.get(name)
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

    def _folder(self, name: str) -> Path:
        """A component this run loads: its files, where loading would read them (the hub's cache included)."""
        return local_folder(self.spec, name)

