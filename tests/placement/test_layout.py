"""The layout (`placement/layout.py`): where every rank of a run sits, as the strategies number
their ranks (the baseline's rank r of R x S is replica r // S, sequence part r % S; a pipeline's
rank is replica x P + stage), and its named device meshes over a real 4-process gloo group."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from relaytrain.placement.layout import DIMS, Coordinates, Layout
from relaytrain.strategies import strategy_class
from tests.conftest import tiny_cfg
from tests.placement.test_tensor_parallel import on_tensor_ranks


def test_ranks_number_the_grid_with_the_last_dim_fastest():
    layout = Layout(replicate=2, sequence=3)
    assert layout.size == 6
    for rank in range(6):
        place = layout.coordinates(rank)
        assert (place.replicate, place.sequence) == (rank // 3, rank % 3)  # the baseline's numbering
        assert layout.rank_of(replicate=place.replicate, sequence=place.sequence) == rank
    pipelines = Layout(replicate=2, stage=4)
    assert [pipelines.rank_of(replicate=r, stage=s) for r in range(2) for s in range(4)] == list(range(8))
    assert pipelines.coordinates(6) == Coordinates(replicate=1, stage=2)


def test_every_rank_round_trips_through_its_coordinates_in_every_dim():
    layout = Layout(replicate=2, shard=2, stage=2, sequence=2, tensor=2)
    seen = set()
    for rank in range(layout.size):
        place = layout.coordinates(rank)
        seen.add(place)
        assert layout.rank_of(**{dim: getattr(place, dim) for dim in DIMS}) == rank
    assert len(seen) == 32
    assert layout.coordinates(1) == Coordinates(tensor=1)  # tensor parts are neighbours


def test_groups_share_every_coordinate_but_their_dims():
    layout = Layout(replicate=2, sequence=2, tensor=2)
    assert layout.groups("tensor") == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert layout.groups("sequence") == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert layout.groups("replicate") == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert layout.group(5, "replicate", "sequence") == [1, 3, 5, 7]  # the data-parallel peers of tensor part 1
    assert layout.groups("shard") == [[r] for r in range(8)]  # a dim of degree 1: each rank alone


def test_row_shares_count_replicas_and_shards_not_the_parts_that_share_rows():
    layout = Layout(replicate=2, shard=3, sequence=2, tensor=2)
    assert layout.data_parallel == 6
    assert [layout.row_share(r) for r in range(0, 24, 4)] == [0, 1, 2, 3, 4, 5]
    assert {layout.row_share(r) for r in layout.group(0, "sequence", "tensor")} == {0}


def test_a_rank_is_described_by_the_dims_in_use():
    assert Layout(replicate=2, tensor=2).describe(3) == "rank 3 (replica 1 of 2, tensor part 1 of 2)"
    assert Layout(replicate=2, stage=3).describe(4) == "rank 4 (replica 1 of 2, stage 1 of 3)"
    assert Layout(shard=4, sequence=2).describe(5) == "rank 5 (shard 2 of 4, sequence part 1 of 2)"
    assert Layout().describe(0) == "rank 0"


def test_what_is_outside_the_layout_is_refused():
    layout = Layout(replicate=2)
    for bad in (lambda: layout.coordinates(2), lambda: layout.rank_of(replicate=2), lambda: layout.rank_of(expert=1),
                lambda: layout.group(0, "pipeline"), lambda: Layout(tensor=0)):
        with pytest.raises(ValueError):
            bad()


@pytest.mark.parametrize(("overrides", "processes", "replicas", "described"), [
    (["strategy=baseline", "strategy.replicas=2", "strategy.sequence_parallel=2"], 4, 2,
     "rank 3 (replica 1 of 2, sequence part 1 of 2)"),
    (["strategy=fsdp", "strategy.replicas=2", "strategy.sequence_parallel=2"], 4, 2,
     "rank 3 (shard 1 of 2, sequence part 1 of 2)"),
    (["strategy=l2l", "strategy.replicas=3"], 3, 3, "rank 2 (replica 2 of 3)"),
    (["strategy=pipe_flush", "strategy.stages=2", "strategy.replicas=2"], 4, 2, "rank 3 (replica 1 of 2, stage 1 of 2)"),
])
def test_every_strategy_counts_and_names_its_processes_from_its_layout(overrides, processes, replicas, described):
    cfg = tiny_cfg("gpt2", *overrides)
    cls = strategy_class(cfg.strategy.name)
    assert (cls.processes(cfg), cls.replicas(cfg)) == (processes, replicas)
    assert cls.describe_process(cfg, processes - 1) == described


# --------------------------------------------------------------------------- meshes over real process groups
# (`on_tensor_ranks`: a job on processes of one gloo group; the 1-D mesh it hands over is not used)


def _group_sum(mesh) -> int:
    """The ranks of `mesh`'s group, summed over it: which processes a collective on it reaches."""
    total = torch.tensor([dist.get_rank()])
    dist.all_reduce(total, group=mesh.get_group())
    return int(total)


def _two_by_two(_mesh) -> dict:
    rank, layout = dist.get_rank(), Layout(replicate=2, tensor=2)
    mesh = layout.mesh("cpu")
    assert layout.mesh("cpu") is mesh  # made once
    place = layout.coordinates(rank)
    return {
        "names": mesh.mesh_dim_names, "shape": tuple(mesh.shape),
        "local": (mesh["replicate"].get_local_rank(), mesh["tensor"].get_local_rank()),
        "place": (place.replicate, place.tensor),
        "tensor": (_group_sum(layout.submesh("cpu", "tensor")), sum(layout.group(rank, "tensor"))),
        "replicate": (_group_sum(mesh["replicate"]), sum(layout.group(rank, "replicate"))),
        "whole": (_group_sum(layout.submesh("cpu", "replicate", "tensor")), layout.submesh("cpu", "tensor").size()),
    }


def test_a_two_dimensional_mesh_runs_collectives_along_the_layouts_groups(tmp_path):
    for rank, got in enumerate(on_tensor_ranks(_two_by_two, tmp_path, 4)):
        assert got["names"] == ("replicate", "tensor") and got["shape"] == (2, 2)
        assert got["local"] == got["place"] == (rank // 2, rank % 2)
        assert got["tensor"][0] == got["tensor"][1]  # a sum over its tensor group reaches exactly those ranks
        assert got["replicate"][0] == got["replicate"][1]
        assert got["whole"] == (0 + 1 + 2 + 3, 2)  # along every dim: the whole run
