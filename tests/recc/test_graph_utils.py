"""graph_utils.replace_uses / flush_uses / rename: the graph and names fx's own calls give, without
the n^2 (issue 42, item 5)."""
import torch
import torch.fx as fx

from recc.graph_utils import WIDE_USER, flush_uses, rename, replace_uses


def _graph(n):
    g = fx.Graph()
    xs = [g.placeholder(f"x{i}") for i in range(n)]
    ys = [g.call_function(torch.neg, (x,)) for x in xs]
    cat = g.call_function(torch.cat, (ys,), {"dim": 1})
    side = g.call_function(torch.add, (ys[-1], ys[0]))   # a narrow user beside the wide one
    g.output((cat, side))
    return g, xs, ys


def _swap_all(g, xs, ys, deferred):
    pending = {}
    for x, y in zip(xs, ys):
        with g.inserting_before(y):
            z = g.call_function(torch.abs, (x,))
        if deferred:
            replace_uses(y, z, pending)
        else:
            y.replace_all_uses_with(z)
        name = y.name
        g.erase_node(y)
        rename(z, name)
    flush_uses(pending)


def _shape(g):
    return [(n.name, n.op, str(n.target), repr(n.args), [u.name for u in n.users], [a.name for a in n.all_input_nodes])
            for n in g.nodes]


def test_deferred_uses_leave_the_graph_fx_leaves():
    for n in (3, WIDE_USER + 5):
        a, b = _graph(n), _graph(n)
        _swap_all(*a, deferred=False)
        _swap_all(*b, deferred=True)
        assert _shape(a[0]) == _shape(b[0])
        assert [x.name for x in a[0].nodes][n:2 * n] == [f"neg{'' if i == 0 else f'_{i}'}" for i in range(n)]
        a[0].lint()
        b[0].lint()


def test_rename_takes_a_freed_name_and_never_a_live_one():
    g, xs, ys = _graph(4)
    rename(ys[1], "x0")          # held by a live placeholder: fx picks a variant
    assert ys[1].name != "x0" and xs[0].name == "x0"
    old = ys[2].name
    with g.inserting_before(ys[2]):
        z = g.call_function(torch.abs, (xs[2],))
    ys[2].replace_all_uses_with(z)
    g.erase_node(ys[2])
    rename(z, old)               # freed by the erase: taken as is
    assert z.name == old
    rename(ys[3], "fresh")
    rename(ys[0], "fresh")       # "fresh" is live again (ys[3]): a variant
    assert ys[3].name == "fresh" and ys[0].name != "fresh"
