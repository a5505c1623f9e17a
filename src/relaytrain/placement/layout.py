"""Where every process of a run sits: its coordinates along the run's degrees of parallelism,
and the named device meshes over them.

A run's processes form a grid of five dims (`DIMS`), outermost first:

    replicate  R  whole copies of the trained state, each on its own rows of every minibatch
                  (the baseline's and L2L's replicas, the pipelines' replicas)
    shard      D  workers each holding 1/D of the trained state, each on its own rows (FSDP)
    stage      P  consecutive parts of the model, every micro-batch flowing through them (pipelines)
    sequence   S  workers sharing every sequence, 1/S of its tokens each (sequence parallelism)
    tensor     T  workers sharing every block, 1/T of its heads and MLP width each (tensor parallelism)

Expert parallelism (`strategy.expert_parallel=E`) is not a dim of the grid: it regroups the
data-parallel workers (replicas or shards) in groups of E consecutive ones, each worker of a group
holding 1/E of every block's experts (`experts`, `expert_groups`). A layout with E > 1 does not
replicate the whole model, even over replicas alone.

Ranks number the grid row-major in that order, the last dim varying fastest. That is the
numbering every strategy used before this object existed, so checkpoints, logs and error messages
keep their meaning: the baseline's rank r of R x S is replica r // S, sequence part r % S; a
pipeline's rank is replica * P + stage. The order also follows the traffic: the further in a
dim, the more often its workers talk (a replica's gradients once a step, a tensor part's
activations twice a block), and consecutive ranks share a machine.

A strategy's class builds its run's layout from the config (`Strategy.rank_layout`); every
process's strategy instance holds one, and with it the device meshes, made once per process on
first use (`mesh`, `submesh`). Coordinates need no process group: a dry run, whose processes
are threads, asks them too, and makes no mesh.
"""

from __future__ import annotations

import collections
import itertools
import math
from dataclasses import dataclass, field

from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

DIMS = ("replicate", "shard", "stage", "sequence", "tensor")  # outermost first
# How a process's place along each dim is named to the user (`Layout.describe`).
LABELS = {"replicate": "replica", "shard": "shard", "stage": "stage", "sequence": "sequence part",
          "tensor": "tensor part"}


# One process's place along every dim, 0 along a dim of degree 1 (`place.stage`, `place._asdict()`).
Coordinates = collections.namedtuple("Coordinates", DIMS, defaults=(0,) * len(DIMS))


@dataclass(frozen=True)
class Layout:
    """The degrees of a run's parallelism (1: the dim is not used); its size is their product."""

    replicate: int = 1
    shard: int = 1
    stage: int = 1
    sequence: int = 1
    tensor: int = 1
    experts: int = 1  # E: the data-parallel workers sharing out every block's experts (see the module)
    # The device meshes made so far in this process, by device type and dims (see `mesh`).
    _meshes: dict = field(default_factory=dict, init=False, repr=False, compare=False, hash=False)

    def __post_init__(self):
        for dim in (*DIMS, "experts"):
            degree = getattr(self, dim)
            if not isinstance(degree, int) or degree < 1:
                raise ValueError(f"a layout's {dim} degree must be a positive int, not {degree!r}")

    # -- degrees ----------------------------------------------------------------------------------
    @property
    def degrees(self) -> dict[str, int]:
        return {dim: getattr(self, dim) for dim in DIMS}

    @property
    def size(self) -> int:
        """Processes in the run."""
        return math.prod(self.degrees.values())

    @property
    def replicates_whole(self) -> bool:
        """Whether every process holds the whole model: replicas alone (no shards, stages,
        sequence or tensor parts), each holding every expert."""
        return self.replicate == self.size and self.experts == 1

    @property
    def data_parallel(self) -> int:
        """How many shares every minibatch's rows are split into: one per replica and shard."""
        return self.replicate * self.shard

    @property
    def mesh_dims(self) -> tuple[str, ...]:
        """The dims a process group runs along: those of degree > 1, outermost first."""
        return tuple(dim for dim in DIMS if getattr(self, dim) > 1)

    # -- rank <-> coordinates ---------------------------------------------------------------------
    def coordinates(self, rank: int) -> Coordinates:
        self._check_rank(rank)
        place = {}
        for dim in reversed(DIMS):
            rank, place[dim] = divmod(rank, getattr(self, dim))
        return Coordinates(**place)

    def rank_of(self, **coordinates: int) -> int:
        """The rank at these coordinates (a dim left out: 0)."""
        unknown = set(coordinates) - set(DIMS)
        if unknown:
            raise ValueError(f"a layout has no dim {', '.join(sorted(unknown))}; its dims are {', '.join(DIMS)}")
        rank = 0
        for dim in DIMS:
            at, degree = coordinates.get(dim, 0), getattr(self, dim)
            if not 0 <= at < degree:
                raise ValueError(f"{dim} {at} is outside a layout of {dim} degree {degree}")
            rank = rank * degree + at
        return rank

    def row_share(self, rank: int) -> int:
        """Which of the `data_parallel` shares of every minibatch's rows `rank` computes on (the
        stages, sequence parts and tensor parts of one share compute on the same rows)."""
        place = self.coordinates(rank)
        return place.replicate * self.shard + place.shard

    def group(self, rank: int, *dims: str) -> list[int]:
        """The ranks that differ from `rank` only along `dims` (itself included), in rank order."""
        self._check_dims(dims)
        place = self.coordinates(rank)
        fixed = {dim: getattr(place, dim) for dim in DIMS if dim not in dims}
        varied = [dim for dim in DIMS if dim in dims]
        return sorted(self.rank_of(**fixed, **dict(zip(varied, at, strict=True)))
                      for at in itertools.product(*(range(getattr(self, dim)) for dim in varied)))

    def groups(self, *dims: str) -> list[list[int]]:
        """Every group of ranks that differ only along `dims`, ordered by their first rank: the
        order in which every process makes their process groups (torch requires one order)."""
        seen, out = set(), []
        for rank in range(self.size):
            if rank not in seen:
                members = self.group(rank, *dims)
                seen.update(members)
                out.append(members)
        return out

    def expert_groups(self) -> tuple[list[list[int]], list[list[int]]]:
        """Expert parallelism over the data-parallel workers, replicas or shards: (the groups of
        `experts` consecutive workers that share every block's experts, the groups holding the same
        share: one member of each), every other coordinate alike; in first-rank order, as every
        process makes their process groups."""
        size = self.experts
        if self.data_parallel % size:
            raise ValueError(f"{size} does not divide a layout's {self.data_parallel} data-parallel workers")
        shares: dict[tuple, list[int]] = {}
        holders: dict[tuple, list[int]] = {}
        for rank in range(self.size):
            share, others = self.row_share(rank), self.coordinates(rank)._replace(replicate=0, shard=0)
            shares.setdefault((share // size, others), []).append(rank)
            holders.setdefault((share % size, others), []).append(rank)
        return list(shares.values()), list(holders.values())

    def expert_share(self, rank: int) -> int:
        """Which of its expert group's `experts` shares of the experts `rank` holds."""
        return self.row_share(rank) % self.experts

    def expert_mesh(self, device_type: str) -> DeviceMesh:
        """A 2-D mesh of the expert groups (`expert_groups`): "expert_data" along the workers
        holding the same share, "experts" along a group (consecutive ranks), for a run whose every
        process is a data-parallel worker (no stage, sequence or tensor dim)."""
        if self.size != self.data_parallel:
            raise ValueError(f"an expert mesh spans data-parallel workers only, not a layout of {self.mesh_dims}")
        return self._made((device_type, "experts"), lambda: init_device_mesh(
            device_type, (self.size // self.experts, self.experts), mesh_dim_names=("expert_data", "experts")))

    def describe(self, rank: int) -> str:
        """How a message names `rank`: "rank 3 (replica 1 of 2, tensor part 1 of 2)"."""
        place = self.coordinates(rank)
        where = [f"{LABELS[dim]} {getattr(place, dim)} of {getattr(self, dim)}" for dim in self.mesh_dims]
        if self.experts > 1:
            where.append(f"expert share {self.expert_share(rank)} of {self.experts}")
        return f"rank {rank} ({', '.join(where)})" if where else f"rank {rank}"

    # -- device meshes ----------------------------------------------------------------------------
    def mesh(self, device_type: str) -> DeviceMesh:
        """The run's device mesh over the default process group, one named dim for each of
        `mesh_dims` (`mesh["tensor"]`, `mesh["replicate", "shard"]` slice it); a run of one
        process: a mesh of one, named "replicate". Made on the first call of each process
        (every process must make it, in the same order as its other process groups)."""
        dims = self.mesh_dims or ("replicate",)
        return self._made((device_type, dims), lambda: init_device_mesh(
            device_type, tuple(getattr(self, dim) for dim in dims), mesh_dim_names=dims))

    def submesh(self, device_type: str, *dims: str) -> DeviceMesh:
        """A 1-D mesh along `dims` (several: flattened into one, named "shard_sequence"), each
        process's group being `group(rank, *dims)`. Along every dim of degree > 1 it is the
        whole run, over the default process group (no group is made); else a slice of `mesh`,
        so that a mesh along the other dims (DTensor's "tensor") shares its root, as FSDP and
        tensor parallelism need together."""
        self._check_dims(dims)
        used = tuple(dim for dim in DIMS if dim in dims and getattr(self, dim) > 1)
        name = "_".join(used or [dim for dim in DIMS if dim in dims])
        if set(used) == set(self.mesh_dims):
            return self._made((device_type, name), lambda: init_device_mesh(
                device_type, (self.size,), mesh_dim_names=(name,)))
        if not used:
            raise ValueError(f"dims {', '.join(dims)} have degree 1 in a layout of {self.size} processes: "
                             f"no mesh runs along them")
        whole = self.mesh(device_type)
        return whole[name] if len(used) == 1 else self._made((device_type, name), lambda: whole[used]._flatten(name))

    def _made(self, key, make):
        if key not in self._meshes:
            self._meshes[key] = make()
        return self._meshes[key]

    def _check_rank(self, rank: int) -> None:
        if not 0 <= rank < self.size:
            raise ValueError(f"rank {rank} is outside a layout of {self.size} processes")

    @staticmethod
    def _check_dims(dims) -> None:
        unknown = [dim for dim in dims if dim not in DIMS]
        if unknown:
            raise ValueError(f"a layout has no dim {', '.join(unknown)}; its dims are {', '.join(DIMS)}")
