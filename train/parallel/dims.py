"""ParallelDims: the parallel degrees of a run, checked once, and the one DeviceMesh built from them.

The world is laid out row-major over five named dimensions, outermost first:

    pp x dp_replicate x dp_shard x cp x tp   (rank = (((p * dp_replicate + r) * dp_shard + s) * cp + c) * tp + t)

so tensor-parallel peers are neighbours (one node, fastest links), replicas are far apart and pipeline
stages farthest (they exchange one activation per microbatch, point to point).
Every other module asks this object, never the environment: which strategies are on, a rank's
coordinates, and the (sub)meshes by name. The mesh always has all five dimensions (size 1 where a
strategy is off) plus two flattened ones, so no caller ever has to assume a 1-D mesh:

    "dp"           dp_replicate x dp_shard   ranks that see different samples (loss all-reduce)
    "dp_shard_cp"  dp_shard x cp             the FSDP sharding dimension (cp ranks share weights)
"""

from __future__ import annotations

from dataclasses import dataclass, fields

from vt.shared.errors import UserError

MESH_DIMS = ("pp", "dp_replicate", "dp_shard", "cp", "tp")
FLATTENED = {"dp": ("dp_replicate", "dp_shard"), "dp_shard_cp": ("dp_shard", "cp")}


class ParallelConfigError(UserError):
    """Parallel degrees that do not fit the launched world; the message says what to set."""


def layout_plan(spec, kind: str):
    """The family's "tp" or "cp" plan (its layout role), refused in one line where it has none (a setting without
    one raises the spec's own Unplanned, a UserError too)."""
    plan = getattr(spec, f"{kind}_plan")()
    if plan is None:
        raise ParallelConfigError(
            f"family {spec.family!r} has no {kind.upper()} plan; set parallel.{kind} = 1 (or "
            f"add {kind}_plan() to its spec file)"
        )
    return plan


@dataclass(frozen=True)
class ParallelDims:
    """Degrees of data (replicate, shard), context and tensor parallelism for `world_size` ranks.

    `dp_shard = -1` takes whatever the other degrees leave of the world size. A product that does
    not match the world size stops the run here, before any process group work, with the fix.
    """

    dp_replicate: int = 1
    dp_shard: int = -1
    cp: int = 1
    tp: int = 1
    world_size: int = 1
    # FSDP2's CPU offload: shard (FSDP2) even over one rank, so a one-GPU run can keep its
    # parameters, gradients and optimizer state in CPU memory.
    cpu_offload: bool = False
    pp: int = 1  # pipeline stages (the outermost mesh dimension)

    def __post_init__(self) -> None:
        for f in fields(self):
            if f.name in ("cpu_offload",):
                continue
            value = getattr(self, f.name)
            if isinstance(value, bool) or not isinstance(value, int):
                raise ParallelConfigError(f"parallel.{f.name} must be an integer, got {value!r}")
        if self.world_size < 1:
            raise ParallelConfigError(f"world size must be >= 1, got {self.world_size}")
        for name in ("dp_replicate", "cp", "tp", "pp"):
            if getattr(self, name) < 1:
                raise ParallelConfigError(f"parallel.{name} must be >= 1, got {getattr(self, name)}")
        others = self.pp * self.dp_replicate * self.cp * self.tp
        if self.dp_shard == -1:
            if self.world_size % others:
                raise ParallelConfigError(
                    f"parallel.pp x dp_replicate x cp x tp = {self.pp} x {self.dp_replicate} x {self.cp} x {self.tp} = "
                    f"{others} does not divide the world size {self.world_size}, so parallel.dp_shard = -1 cannot "
                    f"fill the rest. Launch a multiple of {others} processes or lower those degrees."
                )
            object.__setattr__(self, "dp_shard", self.world_size // others)
        elif self.dp_shard < 1:
            raise ParallelConfigError(f"parallel.dp_shard must be >= 1 or -1 (the rest), got {self.dp_shard}")
        product = others * self.dp_shard
        if product != self.world_size:
            raise ParallelConfigError(
                f"parallel degrees pp x dp_replicate x dp_shard x cp x tp = {self.pp} x {self.dp_replicate} x "
                f"{self.dp_shard} x {self.cp} x {self.tp} = {product}, but {self.world_size} processes were launched "
                f"(torchrun --nnodes x --nproc-per-node). Launch {product} processes, or set degrees whose "
                f"product is {self.world_size}, e.g. --set parallel.dp_shard=-1 to let data-parallel "
                f"sharding take the rest."
            )

    @classmethod
    def from_config(cls, parallel, world_size: int) -> "ParallelDims":
        """From the config's [parallel] section (dp_replicate, dp_shard, cp, tp, cpu_offload, pp). An unresolved
        `dp_shard = "auto"` counts as -1 (the sharded layout): the trainer resolves it before it builds the
        world (parallel/layout.py), `vt-train plan` plans what it would pick."""
        dp_shard = -1 if parallel.dp_shard == "auto" else parallel.dp_shard
        return cls(
            parallel.dp_replicate, dp_shard, parallel.cp, parallel.tp, world_size, parallel.cpu_offload, parallel.pp
        )

    # -- what is on ----------------------------------------------------------------------------------
    @property
    def dp(self) -> int:
        """Data-parallel degree: how many different slices of each global batch exist."""
        return self.dp_replicate * self.dp_shard

    @property
    def fsdp_enabled(self) -> bool:
        """FSDP2 shards over dp_shard x cp (cp ranks hold the same weights); HSDP adds dp_replicate.
        CPU offload is an FSDP2 policy, so it turns FSDP2 on even where there is one rank to shard over."""
        return self.dp_shard * self.cp > 1 or self.cpu_offload

    @property
    def ddp_enabled(self) -> bool:
        """Plain replication (DDP) when there is nothing to shard over but there are replicas."""
        return not self.fsdp_enabled and self.dp_replicate > 1

    @property
    def hsdp_enabled(self) -> bool:
        return self.fsdp_enabled and self.dp_replicate > 1

    @property
    def distributed(self) -> bool:
        """A process group and a mesh: several ranks, or FSDP2 over one (CPU offload)."""
        return self.world_size > 1 or self.fsdp_enabled

    def describe(self) -> str:
        strategy = (
            "HSDP"
            if self.hsdp_enabled
            else "FSDP2"
            if self.fsdp_enabled
            else "DDP"
            if self.ddp_enabled
            else "no data parallelism"
        )
        stages = f"pp {self.pp} x " if self.pp > 1 else ""
        return (
            f"world {self.world_size} = {stages}dp_replicate {self.dp_replicate} x dp_shard {self.dp_shard} x "
            f"cp {self.cp} x tp {self.tp} ({strategy})"
        )

    # -- coordinates (pure, no process group needed) -------------------------------------------------
    def coordinate(self, rank: int) -> dict[str, int]:
        """rank -> index along each mesh dimension, in the mesh's row-major layout."""
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} is outside the world of {self.world_size}")
        sizes = dict(zip(MESH_DIMS, (self.pp, self.dp_replicate, self.dp_shard, self.cp, self.tp)))
        coords: dict[str, int] = {}
        for name in reversed(MESH_DIMS):
            coords[name] = rank % sizes[name]
            rank //= sizes[name]
        return {name: coords[name] for name in MESH_DIMS}

    def dp_rank(self, rank: int) -> int:
        """Which data-parallel slice `rank` trains on (ranks of one pp/cp/tp group share it)."""
        c = self.coordinate(rank)
        return c["dp_replicate"] * self.dp_shard + c["dp_shard"]

    # -- the mesh ------------------------------------------------------------------------------------
    def build_mesh(self, device_type: str) -> "Meshes":
        """The 5-D DeviceMesh named MESH_DIMS plus the flattened dims; needs an initialised process group."""
        from torch.distributed.device_mesh import init_device_mesh

        shape = (self.pp, self.dp_replicate, self.dp_shard, self.cp, self.tp)
        root = init_device_mesh(device_type, shape, mesh_dim_names=MESH_DIMS)
        return Meshes(root, {flat: root[parts]._flatten(flat) for flat, parts in FLATTENED.items()})

    def fsdp_mesh_dims(self) -> tuple[str, ...]:
        """The mesh FSDP2 shards over: (shard,) or, for HSDP, (replicate, shard); cp joins the shard dim."""
        shard = "dp_shard_cp" if self.cp > 1 else "dp_shard"
        return ("dp_replicate", shard) if self.dp_replicate > 1 else (shard,)


class Meshes:
    """The root mesh and its flattened dimensions, looked up by name: `meshes["dp"]`, `meshes["dp_replicate", "dp_shard"]`."""

    def __init__(self, root, flattened: dict):
        self.root = root
        self.flattened = flattened

    def __getitem__(self, names):
        names = (names,) if isinstance(names, str) else tuple(names)
        if len(names) == 1 and names[0] in self.flattened:
            return self.flattened[names[0]]
        if any(name in self.flattened for name in names):
            import warnings

            with warnings.catch_warnings():  # slicing a flattened dim with others: the only way to get HSDP x CP
                warnings.filterwarnings("ignore", message="Slicing a flattened dim")
                return self.root[names]
        return self.root[names]
