"""Where the output dist's received columns land (``output_dist.placement_runs``): the runs the
one-pass decode/encode uses, checked against the column map the general path applies."""
from recc.runtime.comm.output_dist import column_map, placement_runs, received_columns
from recc.specs import CommSpec


def spec(layout, dims, width):
    return CommSpec(op="output_dist", group=(0, 1), layout=tuple(layout), dims=tuple(dims),
                    rows=tuple(100 for _ in dims), width=width)


def expand(runs):
    """Output column of every received column, in received order, from the runs."""
    cols = []
    for src_runs in runs:
        mine = {}
        for src, dst, n in src_runs:
            for i in range(n):
                mine[src + i] = dst + i
        cols.extend(mine[i] for i in range(len(mine)))
    return cols


def test_table_wise_in_order_is_one_run_per_source():
    comm = spec([(0, 0, 0, 100, 0, 4), (1, 0, 0, 100, 0, 4), (2, 1, 0, 100, 0, 4)], [4, 4, 4], 4)
    runs = placement_runs(comm, [2, 1])
    assert runs == [[(0, 0, 8)], [(0, 8, 4)]]
    assert column_map(comm, [2, 1])[0] == "identity"


def test_interleaved_owners_and_column_blocks_follow_the_permutation():
    # table 0 on rank 1, table 1 on rank 0; table 2 split into two column blocks on ranks 0 and 1
    layout = [(0, 1, 0, 100, 0, 4), (1, 0, 0, 100, 0, 4), (2, 0, 0, 100, 0, 4), (2, 1, 0, 100, 4, 8)]
    comm = spec(layout, [4, 4, 8], 4)
    runs = placement_runs(comm, [2, 2])
    assert expand(runs) == received_columns(comm, [2, 2])
    assert runs == [[(0, 4, 8)], [(0, 0, 4), (4, 12, 4)]]
    assert column_map(comm, [2, 2])[0] == "permute"


def test_row_blocks_that_add_up_have_no_runs():
    comm = spec([(0, 0, 0, 50, 0, 4), (0, 1, 50, 100, 0, 4)], [4], 4)
    assert placement_runs(comm, [1, 1]) is None
    assert column_map(comm, [1, 1])[0] == "add"


def test_a_rank_without_shards_gets_no_runs():
    comm = spec([(0, 1, 0, 100, 0, 4), (1, 1, 0, 100, 0, 4)], [4, 4], 4)
    assert placement_runs(comm, [0, 2]) == [[], [(0, 0, 8)]]
