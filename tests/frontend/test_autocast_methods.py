"""Autocast over matrix products written as methods or operators (``x.matmul(w)``, ``x @ w``,
``x.mm(w)``, ``torch.matmul``), not only ``nn.Linear`` and ``torch.bmm``.

capture notes the autocast each node was recorded under and ``autocast_of`` collects it over the
graph's matrix products (``graph_utils.is_matrix_product``). A product form missing from that set
is invisible to both: a forward that runs it outside its autocast compiles silently instead of
being refused, and one that runs only such products under autocast compiles as fp32. These tests
read the capture's record itself (the mechanism), then what compile does with it."""
from __future__ import annotations

import operator

import pytest
import torch
import torch.nn as nn

import recc
from recc.trace import AUTOCAST, autocast_of, trace

# Each form of product the user may write, and the fx node it becomes (op, target).
FORMS = {
    "method_matmul": (lambda h, w: h.matmul(w), ("call_method", "matmul")),
    "operator_at": (lambda h, w: h @ w, ("call_function", operator.matmul)),
    "method_mm": (lambda h, w: h.mm(w), ("call_method", "mm")),
    "torch_matmul": (lambda h, w: torch.matmul(h, w), ("call_function", torch.matmul)),
}


class Tower(nn.Module):
    """A pooled lookup, an nn.Linear, then the product under test on a raw parameter.
    ``where`` is which part runs under bf16 autocast: "all", "product" (only the product) or
    "linear" (only the nn.Linear; the product outside)."""

    def __init__(self, form: str, where: str):
        super().__init__()
        self.form, self.where = form, where
        self.emb = nn.EmbeddingBag(20, 8, mode="sum")
        self.proj = nn.Linear(8, 8)
        self.kernel = nn.Parameter(torch.randn(8, 4) * 0.3)

    def product(self, h):
        if self.where in ("all", "product"):
            with torch.autocast("cpu", dtype=torch.bfloat16):
                return FORMS[self.form][0](h, self.kernel)
        return FORMS[self.form][0](h, self.kernel)

    def forward(self, ids, offsets):
        h = self.emb(ids, offsets)
        if self.where in ("all", "linear"):
            with torch.autocast("cpu", dtype=torch.bfloat16):
                h = torch.relu(self.proj(h)).float()   # fp32 again for a product outside it
        else:
            h = torch.relu(self.proj(h))
        return self.product(h).float().sum(1)


def _inputs():
    g = torch.Generator().manual_seed(0)
    return torch.randint(0, 20, (12,), generator=g), torch.arange(0, 12, 2)


def _product_node(gm, form):
    op, target = FORMS[form][1]
    (node,) = [n for n in gm.graph.nodes if n.op == op and n.target == target]
    return node


@pytest.mark.parametrize("form", FORMS)
def test_capture_records_the_autocast_of_a_method_or_operator_product(form):
    """The product node carries the autocast it was traced under, and ``autocast_of`` counts it
    as a matrix product inside bf16 autocast (not ignored as a non-product)."""
    torch.manual_seed(0)
    gm = trace(Tower(form, "all"), _inputs())
    node = _product_node(gm, form)
    assert node.meta.get(AUTOCAST) == {"cpu": torch.bfloat16}
    inside, outside = autocast_of(gm, "cpu")
    assert inside.get(node) == torch.bfloat16, f"{node.name} not seen as a product under autocast: {inside}"
    assert not outside


@pytest.mark.parametrize("form", FORMS)
def test_a_method_product_outside_the_autocast_is_counted_outside(form):
    """The nn.Linear under autocast, the product not: autocast_of lists the product outside, so
    compile refuses the split naming it (a product form it does not know would pass silently,
    running that product in fp32 where nothing said so)."""
    torch.manual_seed(0)
    gm = trace(Tower(form, "linear"), _inputs())
    node = _product_node(gm, form)
    inside, outside = autocast_of(gm, "cpu")
    assert node in outside and node not in inside
    with pytest.raises(ValueError, match=rf"Tower\.forward runs some of its matrix products under torch\.autocast"
                                         rf"\('cpu'\) and not others: .* {node.name} outside it"):
        recc.compile(Tower(form, "linear"), recc.Cluster.local(1), example_inputs=_inputs())


@pytest.mark.parametrize("form", FORMS)
def test_an_autocast_around_a_method_product_compiles_it_in_bf16(form):
    """Autocast around the whole forward: the model compiles as dense_dtype='bf16' and the
    product node itself computes bf16 on a bf16 cast of the parameter (cast_dense knows the
    form too); its output is within bf16 rounding of eager under the same autocast."""
    torch.manual_seed(0)
    model = Tower(form, "all")
    program = recc.compile(model, recc.Cluster.local(1), example_inputs=_inputs())
    assert program.config.dense_dtype == "bf16"
    text = program.stages["cast_dense"].text
    name = _product_node(trace(Tower(form, "all"), _inputs()), form).name
    (line,) = [ln for ln in text.splitlines() if ln.split(":")[0].strip() == name]
    assert line.split("=")[0].split(":")[1].strip().startswith("bf16["), line
    assert "kernel_bf16" in line, line
    with torch.no_grad():
        want = model(*_inputs())
        got = program.instantiate()(*_inputs())
    torch.testing.assert_close(got, want.float(), atol=2e-2, rtol=0)


def test_an_autocast_around_only_a_method_product_is_seen_and_the_split_refused():
    """The only product under autocast is ``h @ w`` (the nn.Linear outside it): recc must see the
    autocast at all, and so refuse the split rather than compile fp32 as if there were none."""
    torch.manual_seed(0)
    with pytest.raises(ValueError, match=r"matmul inside it .*proj outside it"):
        recc.compile(Tower("operator_at", "product"), recc.Cluster.local(1), example_inputs=_inputs())
