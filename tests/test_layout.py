"""Layout arithmetic against a direct enumeration of Megatron's rank order (tp fastest, then cp, dp, pp)."""

import itertools

import pytest

from hetero.errors import ConfigError
from hetero.parallel.layout import Coord, Layout, LayoutSpec, format_ranks


def enumerate_grid(tp, cp, dp, pp, ranks):
    """(global rank, coord) pairs, written as nested loops in Megatron's order."""
    out = []
    i = 0
    for p in range(pp):
        for d in range(dp):
            for c in range(cp):
                for t in range(tp):
                    out.append((ranks[i], Coord(tp=t, cp=c, dp=d, pp=p)))
                    i += 1
    return out


@pytest.mark.parametrize("tp,cp,dp,pp", list(itertools.product([1, 2], [1, 2], [1, 3], [1, 2])))
def test_coordinates_follow_megatron_order(tp, cp, dp, pp):
    size = tp * cp * dp * pp
    ranks = tuple(range(5, 5 + size))
    layout = Layout(tp=tp, cp=cp, dp=dp, pp=pp, ranks=ranks)
    for rank, coord in enumerate_grid(tp, cp, dp, pp, ranks):
        assert layout.coord(rank) == coord
        assert layout.rank_at(coord) == rank
    assert layout.coord(4) is None


def test_groups_vary_only_their_axes():
    layout = Layout(tp=2, cp=2, dp=2, pp=2, ranks=tuple(range(16)))
    assert layout.groups(("tp",))[:2] == [(0, 1), (2, 3)]
    assert layout.groups(("cp",))[:2] == [(0, 2), (1, 3)]
    assert layout.groups(("dp",))[:2] == [(0, 4), (1, 5)]
    assert layout.groups(("pp",))[:2] == [(0, 8), (1, 9)]
    assert layout.groups(("dp", "cp"))[0] == (0, 2, 4, 6)
    for axes in [("tp",), ("cp",), ("dp",), ("pp",), ("dp", "cp")]:
        groups = layout.groups(axes)
        assert sorted(r for g in groups for r in g) == list(range(16))  # a partition of the ranks


def test_explicit_unsorted_ranks_keep_mesh_order():
    layout = LayoutSpec(tp=2, ranks=[0, 4, 1, 5]).resolve("m.layout", 8)
    assert layout.dp == 2
    assert layout.groups(("tp",)) == [(0, 4), (1, 5)]
    assert layout.coord(4) == Coord(tp=1, cp=0, dp=0, pp=0)


def test_spec_resolution():
    assert LayoutSpec(tp=2, dp=2, offset=2).resolve("m", 6).ranks == (2, 3, 4, 5)
    assert LayoutSpec(tp=2, offset=2).resolve("m", 8).dp == 3  # dp inferred from the remaining ranks
    assert LayoutSpec(tp=2, size=4, offset=4).resolve("m", 8).ranks == (4, 5, 6, 7)
    with pytest.raises(ConfigError, match=r"m: tp\*cp\*pp = 3\*1\*1 = 3 does not divide the 4 ranks"):
        LayoutSpec(tp=3).resolve("m", 4)


def test_format_ranks():
    assert format_ranks([0, 1, 2, 3, 6, 8, 9]) == "0-3,6,8-9"
    assert format_ranks([4]) == "4"


def test_expert_groups_split_dp_with_ep_inner():
    """tp2·dp4 over ranks 0-7 with ep2: replicas (0,1) and (2,3) form EP groups at each TP coordinate, and
    replicas 0,2 (and 1,3) hold the same experts, with their TP ranks (which route other tokens). With cp2
    the CP ranks join the expert-data groups."""
    layout = Layout(tp=2, cp=1, dp=4, pp=1, ranks=tuple(range(8)), ep=2)
    assert layout.expert_groups() == [(0, 2), (1, 3), (4, 6), (5, 7)]
    assert layout.expert_data_groups() == [(0, 1, 4, 5), (2, 3, 6, 7)]
    with_cp = Layout(tp=1, cp=2, dp=2, pp=1, ranks=tuple(range(4)), ep=2)
    assert with_cp.expert_groups() == [(0, 2), (1, 3)]
    assert with_cp.expert_data_groups() == [(0, 1), (2, 3)]
    with pytest.raises(ConfigError, match=r"layout\.ep=3 must be >= 1 and divide dp=4"):
        Layout(tp=1, cp=1, dp=4, pp=1, ranks=tuple(range(4)), ep=3)
