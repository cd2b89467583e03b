"""discover_tables: find every embedding lookup in the traced user model.

Contract: requires a traced user model. Ensures every supported lookup —
``nn.EmbeddingBag`` and ``nn.Embedding`` modules (whatever they are called), and
``F.embedding_bag`` / ``F.embedding`` calls on a parameter — is one ``recc.embedding_bag`` node
whose weight is a ``get_attr`` and whose ``meta["recc.table"]`` is a ``TableSpec``; records the
tables in ``ctx.stats["tables"]``. Gathers (``nn.Embedding``: ids of any shape S, rows of shape
S + [D]) become sum-pooled bags of one id each — ``ids.reshape(-1, 1)`` in, ``recc.rows_like``
out — so they batch, shard (table-, row-, column-wise: the output dist then carries the looked-up
rows, TorchRec's sequence sharding) and train like any pooled table. A gather whose ids are not
one row of ``[B, ...]`` per sample (a jagged sequence: 1-D ids of N != B) is marked
``TableSpec.jagged``: its id count differs per rank (``insert_comm`` pads its bags to one count
for the all-to-alls), and it gets a group of its own. ``include_last_offset``
offsets lose their last entry; ``padding_idx`` ids are dropped by ``recc.drop_padding`` (a gather's
padding id is then an empty bag: zeros, as its zero padding row gives, and no gradient). Lookups
recc cannot fuse (``max_norm``, ``scale_grad_by_freq``, a gather whose padding row is not zero) are
left as they are, trained as dense modules, and
listed once in ``ctx.stats["dense_lookups"]`` with the reason; a model with no table at all
compiles with one warning.

A weight looked up at several call sites (the FM and the deep part of a DeepFM reading the same
``nn.Embedding``; DIN's candidate item and behaviour history over one item table; a TorchRec
``EmbeddingBagConfig`` with several ``feature_names``; ``F.embedding(ids, bag.weight)`` beside the
bag module) is ONE table with several lookups: one ``TableSpec`` name and short id (``t0``), one
entry in ``ctx.stats["tables"]`` (the first lookup's spec: rows, dim, dtype, init, placement are
the table's), every lookup its own ``recc.embedding_bag`` whose spec carries that lookup's
pooling, weights, jaggedness and padding id; ``ctx.stats["table_lookups"]`` lists each table's
lookups (node names, in graph order). ``batch_tables`` makes them features of the table's one
group. The lookups of one table run in one fused kernel, so they must pool alike (sum bags and
gathers mix; a mean or max bag only with its own kind) and be all weighted or all unweighted:
otherwise an error names the table and both call sites. A table of fp16 or bf16 (``nn.EmbeddingBag(..., dtype=torch.bfloat16)``,
a TorchRec ``DataType.FP16`` table) is pooled in fp32 like any other and its rows cast to its dtype,
what the module returns; ``TableSpec.user_dtype`` records that dtype (``state_dict`` returns the
table in it) and ``TableSpec.dtype`` the stored one (``CompileConfig.table_dtype``, by default the
module's). A float64 table is refused by name. Must not change what the graph computes.

Before:
    emb_l_0 : f32[8,4]   = emb_l.0(l_s_i_1, l_s_o_1)
    user    : f32[8,1,4] = user(ids)
After:
    emb_l_0_weight : f32[10,4] = get_attr emb_l.0.weight
    emb_l_0        : f32[8,4]  = recc.embedding_bag(emb_l_0_weight, l_s_i_1, l_s_o_1, None, mode='sum', table='emb_l.0')  # table t0=emb_l.0[10x4,sum]
    user_weight    : f32[20,4] = get_attr user.weight
    user_ids       : i64[8,1]  = ids.reshape(-1, 1)
    user_rows      : f32[8,4]  = recc.embedding_bag(user_weight, user_ids, None, None, mode='sum', table='user')  # table t1=user[20x4,sum]
    user           : f32[8,1,4] = recc.rows_like(user_rows, ids)
A table looked up twice (one spec name, two lookups):
    user_1_ids     : i64[40,1] = hist.reshape(-1, 1)
    user_1_rows    : f32[40,4] = recc.embedding_bag(user_weight, user_1_ids, None, None, mode='sum', table='user')  # table t1=user[20x4,none]
A bf16 table:
    half_weight    : bf16[30,4] = get_attr half.weight
    half_lookup    : f32[8,4]   = recc.embedding_bag(half_weight, l_s_i_3, l_s_o_3, None, mode='sum', table='half')  # table t2=half[30x4,sum,bf16]
    half           : bf16[8,4]  = half_lookup.to(bf16)
"""
from __future__ import annotations

import dataclasses
import inspect
import operator
import warnings

import torch
import torch.fx as fx
import torch.nn as nn
import torch.nn.functional as F

from recc.graph_utils import flush_uses, rename, replace_uses, resolve_attr
from recc.ops import OPS
from recc.passmanager import PassContext, register_pass
from recc.specs import TableSpec
from recc.tables import WEIGHT_DTYPES

_BAG_SIG = inspect.signature(F.embedding_bag)
_STORED = {"fp32": "f32", "fp16": "f16", "bf16": "bf16"}  # CompileConfig.table_dtype -> TableSpec.dtype
_OF_TORCH = {v: k for k, v in WEIGHT_DTYPES.items()}  # a weight's dtype -> TableSpec's name
_EMB_SIG = inspect.signature(F.embedding)


def _unsupported_bag(mode, max_norm, scale_grad_by_freq):
    if mode not in ("sum", "mean", "max"):
        return f"mode={mode!r} (recc pools with sum, mean or max)"
    if max_norm is not None:
        return "max_norm (renormalising rows on lookup)"
    if scale_grad_by_freq:
        return "scale_grad_by_freq"
    return None


def _module_init(gm: fx.GraphModule, wpath: str) -> str:
    """How the table's own module initialises it: TorchRec's default inside one of its
    collections (``EmbeddingBagCollection``/``EmbeddingCollection``), else ``nn.Embedding``'s."""
    packages = getattr(gm, "meta", {}).get("recc.module_packages", {})
    parts = wpath.split(".")[:-1]
    for i in range(len(parts), 0, -1):
        if packages.get(".".join(parts[:i]), "").startswith("torchrec."):
            return "torchrec"
    return "normal"


def _nonzero_padding_row(weight, padding_idx):
    """A gather's ``padding_idx`` ids become empty bags, which pool to zeros: exact while the
    padding row is zero, as ``nn.Embedding`` initialises it and never updates it (no gradient)."""
    if padding_idx is None or weight.dim() != 2 or weight.device.type == "meta":
        return None
    if bool(weight.detach()[padding_idx].any()):
        return (f"padding_idx={padding_idx} whose row is not zero (recc looks padding ids up as empty "
                f"bags, which pool to zeros)")
    return None


def _param_path(gm: fx.GraphModule, node) -> str | None:
    return node.target if isinstance(node, fx.Node) and node.op == "get_attr" else None


@register_pass
def discover_tables(gm: fx.GraphModule, ctx: PassContext) -> fx.GraphModule:
    """Find embedding lookups and normalise them to recc.embedding_bag with a TableSpec."""
    tables: dict[str, TableSpec] = {}
    seen_weights: dict[str, str] = {}  # weight path -> table name
    lookups: dict[str, list[str]] = {}  # table name -> its lookups' node names, in graph order
    dense_lookups: dict[str, str] = {}
    graph = gm.graph
    pending = {}  # users whose arguments replace_uses rebuilds once, after the loop
    for node in list(graph.nodes):
        found = None  # (table name, weight path, ids, offsets, psw, mode)
        if node.op == "call_module":
            mod = gm.get_submodule(node.target)
            if isinstance(mod, nn.EmbeddingBag):
                b = inspect.signature(mod.forward).bind(*node.args, **node.kwargs)
                a = b.arguments
                why = _unsupported_bag(mod.mode, mod.max_norm, mod.scale_grad_by_freq)
                if why:
                    dense_lookups[node.target] = why
                    continue
                found = (node.target, f"{node.target}.weight", a.get("input"), a.get("offsets"),
                         a.get("per_sample_weights"), mod.mode, mod.include_last_offset, mod.padding_idx)
            elif isinstance(mod, nn.Embedding):
                why = _unsupported_bag("sum", mod.max_norm, mod.scale_grad_by_freq) or \
                    _nonzero_padding_row(mod.weight, mod.padding_idx)
                if why:
                    dense_lookups[node.target] = why
                    continue
                found = (node.target, f"{node.target}.weight", node.args[0] if node.args else node.kwargs["input"],
                         None, None, "none", False, mod.padding_idx)
        elif node.op == "call_function" and node.target in (F.embedding_bag, F.embedding):
            is_bag = node.target is F.embedding_bag
            a = (_BAG_SIG if is_bag else _EMB_SIG).bind(*node.args, **node.kwargs)
            a.apply_defaults()
            a = a.arguments
            path = _param_path(gm, a["weight"])
            if path is None:
                dense_lookups[node.name] = "weight is not a parameter of the model"
                continue
            name = path[:-len(".weight")] if path.endswith(".weight") else path
            if is_bag:
                why = _unsupported_bag(a["mode"], a["max_norm"], a["scale_grad_by_freq"])
                if why:
                    dense_lookups[name] = why
                    continue
                found = (name, path, a["input"], a["offsets"], a["per_sample_weights"], a["mode"],
                         a["include_last_offset"], a["padding_idx"])
            else:
                why = _unsupported_bag("sum", a["max_norm"], a["scale_grad_by_freq"])
                if why is None and a["padding_idx"] is not None and _is_param(gm, path):
                    why = _nonzero_padding_row(gm.get_parameter(path), a["padding_idx"])
                if why:
                    dense_lookups[name] = why
                    continue
                found = (name, path, a["input"], None, None, "none", False, a["padding_idx"])
        if found is None:
            continue
        name, wpath, ids, offsets, psw, mode, last_offset, padding_idx = found
        first = seen_weights.get(wpath)
        if first is not None:
            name = first  # one table, whatever the call site calls it
        weight = gm.get_parameter(wpath) if _is_param(gm, wpath) else None
        if weight is None:
            raise ValueError(f"discover_tables: table {name}: {wpath} is not a parameter")
        if weight.dim() != 2:
            raise ValueError(f"discover_tables: table {name}: weight must be 2-D, got {tuple(weight.shape)}")
        if weight.dtype not in _OF_TORCH:
            raise ValueError(f"discover_tables: table {name} ({wpath}) is {str(weight.dtype).removeprefix('torch.')}; "
                             f"recc stores tables in float32, float16 or bfloat16 — convert it first (e.g. "
                             f"model.get_submodule({name!r}).float())")
        user_dtype = _OF_TORCH[weight.dtype]
        rows = int(weight.shape[0])
        jagged = mode == "none" and _is_jagged(ids, ctx.batch)
        padding = None if padding_idx is None else padding_idx % rows
        if first is None:
            spec = TableSpec(name=name, short=f"t{len(tables)}", rows=rows, dim=int(weight.shape[1]),
                             pooling=mode, weight_key=wpath, weighted=psw is not None, jagged=jagged,
                             dtype=_STORED[ctx.config.table_dtype] if ctx.config.table_dtype else user_dtype,
                             user_dtype=user_dtype, init=_module_init(gm, wpath), padding_idx=padding)
            tables[name] = spec
            seen_weights[wpath] = name
            lookups[name] = [node.name]
        else:
            # Another lookup of a table already found: the same table (rows, state, placement),
            # this lookup's own pooling, weights and ids.
            spec = _another_lookup(tables[name], lookups[name][0], node.name, mode, psw is not None, jagged, padding)
            lookups[name].append(node.name)
        old_name = node.name
        shared = _field_offsets(gm, ids, int(weight.shape[0]))
        if shared is not None:
            # One table for several fields: check each field's ids stay in its rows.
            source, starts = shared
            with graph.inserting_before(ids):
                checked = graph.call_function(OPS["check_field_ids"], (source, starts),
                                              {"table": name, "rows": int(weight.shape[0])})
            rename(checked, f"{old_name}_field_ids")
            ids.replace_input_with(source, checked)
        with graph.inserting_before(node):
            # A functional lookup already reads its weight through a get_attr: reuse it.
            w = a_weight if (a_weight := _weight_node(node, wpath)) is not None else graph.get_attr(wpath)
            bag_ids = ids
            if mode == "none":
                # A gather is a bag of one id per looked-up position.
                bag_ids = graph.call_method("reshape", (ids, -1, 1))
                rename(bag_ids, f"{old_name}_ids")
            elif last_offset and offsets is not None:
                # include_last_offset: B+1 offsets, the last one the number of ids.
                offsets = graph.call_function(operator.getitem, (offsets, slice(None, -1)))
                rename(offsets, f"{old_name}_offsets")
            if padding_idx is not None:
                # Padding ids are left out of their bags (and of a mean's count), as nn.EmbeddingBag does.
                if padding_idx < 0:
                    padding_idx += int(weight.shape[0])
                kept = graph.call_function(OPS["drop_padding"], (bag_ids, offsets, psw), {"padding_idx": padding_idx, "table": name, "rows": int(weight.shape[0])})
                rename(kept, f"{old_name}_kept")
                parts = [graph.call_function(operator.getitem, (kept, k)) for k in range(3 if psw is not None else 2)]
                for part, what in zip(parts, ("ids", "offsets", "weights")):
                    rename(part, f"{old_name}_{what}")
                bag_ids, offsets = parts[0], parts[1]
                psw = parts[2] if psw is not None else None
            if psw is not None and user_dtype != "f32":
                # A half table's per-sample weights are in its dtype; the lookup pools in fp32.
                psw = graph.call_method("to", (psw, torch.float32))
                rename(psw, f"{old_name}_weights_f32")
            new = graph.call_function(OPS["embedding_bag"], (w, bag_ids, offsets, psw),
                                      {"mode": "sum" if mode == "none" else mode, "table": name})
            out = new
            if mode == "none":
                out = graph.call_function(OPS["rows_like"], (new, ids))
            if user_dtype != "f32":
                # recc.embedding_bag pools in fp32 whatever the storage; the model reads the rows
                # in its table's dtype, as the module would have returned them.
                out = graph.call_method("to", (out, WEIGHT_DTYPES[user_dtype]))
        new.meta["recc.table"] = spec
        replace_uses(node, out, pending)
        graph.erase_node(node)
        # The last node keeps the user's name; before it, a gather's rows and the looked-up value cast.
        rename(out, old_name)
        if mode == "none":
            rename(new, f"{old_name}_rows")
        if user_dtype != "f32":
            rename(out.args[0], f"{old_name}_lookup")
    flush_uses(pending)
    both = sorted(set(tables) & set(dense_lookups))
    if both:
        name = both[0]
        raise ValueError(f"discover_tables: table {name} is looked up at {', '.join(lookups[name])}, which recc fuses, and "
                         f"elsewhere with {dense_lookups[name]}, which it leaves a dense module; one table cannot be "
                         f"both (its rows would train twice over) — use the same lookup options at every call site")
    if not tables:
        warnings.warn(f"recc: {type(gm).__name__} has no embedding table recc can fuse; it compiles as a "
                      f"dense model (every parameter data-parallel)", stacklevel=2)
    for name, why in dense_lookups.items():
        warnings.warn(f"recc: embedding {name} stays a dense module (not fused): it uses {why}", stacklevel=2)
    ctx.stats["tables"] = tables
    ctx.stats["table_lookups"] = {name: tuple(sites) for name, sites in lookups.items()}
    ctx.stats["dense_lookups"] = dense_lookups
    gm.delete_all_unused_submodules()
    return gm


def _kernel_pooling(mode: str) -> str:
    return "sum" if mode == "none" else mode


def _another_lookup(table: TableSpec, first: str, site: str, mode: str, weighted: bool, jagged: bool,
                    padding_idx) -> TableSpec:
    """The TableSpec of a further lookup of ``table``: the table's, with this lookup's pooling,
    weightedness, jaggedness and padding id. Every lookup of a table runs in the table's one
    group, whose kernel pools one way and takes per-sample weights for all or none of its bags:
    lookups that differ there are refused, naming both call sites."""
    if _kernel_pooling(mode) != _kernel_pooling(table.pooling):
        raise ValueError(
            f"discover_tables: table {table.name} is looked up with {table.pooling} pooling at {first} and with "
            f"{mode} pooling at {site}; recc runs every lookup of one table in one fused kernel, which pools "
            f"one way (sum bags and nn.Embedding gathers mix; mean or max bags only with their own kind)")
    if weighted != table.weighted:
        raise ValueError(
            f"discover_tables: table {table.name} is looked up with per_sample_weights at "
            f"{first if table.weighted else site} and without at {site if table.weighted else first}; recc runs "
            f"every lookup of one table in one fused kernel, which takes weights for all its bags or none "
            f"(pass ones for the unweighted lookup)")
    return dataclasses.replace(table, pooling=mode, weighted=weighted, jagged=jagged, padding_idx=padding_idx)


_ADDS = {operator.add, torch.add}


def _field_offsets(gm: fx.GraphModule, ids, rows: int):
    """``(source, starts)`` when ``ids = source + starts`` with ``starts`` a constant of the model
    (a numpy array or buffer, not computed from the inputs): F strictly increasing row offsets
    from 0, one per field along ``source``'s last dim F — a table shared by F fields. None
    otherwise (also for any other way of adding: keyword arguments, offsets along another dim)."""
    if not isinstance(ids, fx.Node) or not (
            (ids.op == "call_function" and ids.target in _ADDS) or (ids.op == "call_method" and ids.target == "add")):
        return None
    if len(ids.args) != 2 or ids.kwargs or not all(isinstance(a, fx.Node) for a in ids.args):
        return None  # (torch.add(x, off, alpha=2) scales the offsets: not field starts)
    for source, starts in (ids.args, ids.args[::-1]):
        src, shaped = source.meta.get("val"), starts.meta.get("val")
        value = _constant_value(gm, starts)
        if value is None or src is None or shaped is None or src.dim() == 0 or value.dtype.is_floating_point:
            continue
        f = int(src.shape[-1])
        # One start per field along ids' last dim (shape [F], [1, F], ...), strictly increasing
        # from 0: every field owns at least one row.
        if tuple(shaped.shape)[-1:] != (f,) or any(d != 1 for d in shaped.shape[:-1]) or shaped.dim() > src.dim():
            continue
        value = value.reshape(-1)
        if value.numel() == f > 1 and int(value[0]) == 0 and bool((value[1:] > value[:-1]).all()) \
                and int(value[-1]) < rows:
            return source, starts
    return None


def _constant_value(gm: fx.GraphModule, node: fx.Node):
    """The tensor behind ``node`` when it is one model constant (a get_attr) passed through ops
    that keep its values (``.to``, ``unsqueeze``, ``view``...), reading at most the dtype/device
    of inputs; else None."""
    keep = {"to", "unsqueeze", "view", "reshape", "long", "int", "contiguous", "clone", "cpu", "cuda"}
    while node.op != "get_attr":
        if node.op != "call_method" or node.target not in keep or not node.args or \
                not isinstance(node.args[0], fx.Node):
            return None
        node = node.args[0]
    value = resolve_attr(gm, node.target)
    return value if isinstance(value, torch.Tensor) and value.device.type != "meta" else None


def _is_jagged(ids, batch) -> bool:
    """A gather whose ids' leading size N is not the batch B (``[B]``, ``[B, L]`` ids are fixed
    length), or whose ids are a ``JaggedTensor``'s values (even when the example's sequences all
    have length 1): a variable-length sequence (``EmbeddingCollection`` over jagged features),
    whose id count differs from rank to rank. A plain 1-D input of exactly B ids in the example is
    taken for one id per sample; if it is not, the input dist names the mismatch at run time."""
    val = ids.meta.get("val") if isinstance(ids, fx.Node) else None
    if val is None or val.dim() == 0:
        return False
    if val.dim() == 1 and ids.op == "call_method" and ids.target == "values":
        return True  # a JaggedTensor's / KeyedJaggedTensor's values: jagged whatever the example's lengths
    return batch is not None and int(val.shape[0]) != batch


def _weight_node(node: fx.Node, wpath: str):
    for a in node.all_input_nodes:
        if a.op == "get_attr" and a.target == wpath:
            return a
    return None


def _is_param(gm: fx.GraphModule, path: str) -> bool:
    try:
        gm.get_parameter(path)
        return True
    except AttributeError:
        return False
