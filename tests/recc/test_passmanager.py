"""The pass manager: spec strings, pipeline resolution and its errors, disabling passes,
options from the config, user passes (registered or plain callables) and print_after."""
from __future__ import annotations

import re

import pytest
import torch

import recc
from recc.passmanager import PASSES, format_spec, parse_spec, resolve_pipeline, shown_options

DEFAULT = "discover_tables,shard_tables,batch_tables,lower"


# ----------------------------------------------------------------------------- spec strings

@pytest.mark.parametrize("spec, items", [
    ("discover_tables", [("discover_tables", {})]),
    ("a,b{k=v,k2=2},c", [("a", {}), ("b", {"k": "v", "k2": 2}), ("c", {})]),
    ("p{f=0.5,i=-3,t=true,n=false,z=none,s=fp16}",
     [("p", {"f": 0.5, "i": -3, "t": True, "n": False, "z": None, "s": "fp16"})]),
    ("discover_tables,shard_tables{strategy=auto},batch_tables,insert_comm,quantize_comm{fwd=fp16,bwd=bf16},"
     "pipeline_comm,lower",
     [("discover_tables", {}), ("shard_tables", {"strategy": "auto"}), ("batch_tables", {}), ("insert_comm", {}),
      ("quantize_comm", {"fwd": "fp16", "bwd": "bf16"}), ("pipeline_comm", {}), ("lower", {})]),
    ("x{big=12345678901234,small=1.5e-07,neg=-0.25}", [("x", {"big": 12345678901234, "small": 1.5e-07, "neg": -0.25})]),
])
def test_spec_round_trips(spec, items):
    parsed = parse_spec(spec)
    assert parsed == items
    for (_, got), (_, want) in zip(parsed, items):
        assert {k: type(v) for k, v in got.items()} == {k: type(v) for k, v in want.items()}
    assert format_spec(parsed) == spec
    assert parse_spec(format_spec(items)) == items


def test_spec_value_types():
    (_, opts), = parse_spec("p{i=3,f=3.0,e=1e-3,b=True,s=hello world,n=None}")
    assert opts == {"i": 3, "f": 3.0, "e": 0.001, "b": True, "s": "hello world", "n": None}
    assert [type(opts[k]) for k in "ifebsn"] == [int, float, float, bool, str, type(None)]
    assert parse_spec(format_spec([("p", opts)])) == [("p", opts)]


def test_spec_whitespace_is_ignored():
    assert parse_spec(" a , b{ k= v , j= 1 } ,c ") == [("a", {}), ("b", {"k": "v", "j": 1}), ("c", {})]
    assert parse_spec("a,\n  b{k=1},\tc\n") == [("a", {}), ("b", {"k": 1}), ("c", {})]
    # Inside a value, whitespace between words is part of the string; around it, it is not.
    assert parse_spec("p{s= hello world ,t=\" padded \"}") == [("p", {"s": "hello world", "t": " padded "})]


@pytest.mark.parametrize("spec, items", [
    ("b { k = v , j = 1 }", [("b", {"k": "v", "j": 1})]),
    ("b{k =v}", [("b", {"k": "v"})]),
    ('b{k="v" ,j=1}', [("b", {"k": "v", "j": 1})]),
])
def test_spec_whitespace_around_braces_and_equals_is_ignored(spec, items):
    assert parse_spec(spec) == items


@pytest.mark.parametrize("bad, where, what", [
    ("a{k=v", "character 5", "unterminated options of pass a"),
    ("a b", "character 2", "expected ','"),
    ("a,,b", "character 2", "expected a pass name"),
    ("1a", "character 0", "expected a pass name"),
    ("a{k=v}}", "character 6", "expected ','"),
    ("a{k=v}b", "character 6", "expected ','"),
    ("a,", "character 2", "expected a pass name"),
    ("a, ", "character 2", "expected a pass name"),
    ("", "character 0", "expected a pass name"),
    ("a{=1}", "character 2", "expected an option name for pass a"),
])
def test_bad_spec_syntax(bad, where, what):
    with pytest.raises(ValueError, match=rf"bad pipeline spec at {where}: {re.escape(what)} in {re.escape(repr(bad))}"):
        parse_spec(bad)


def test_unterminated_quoted_value():
    with pytest.raises(ValueError, match=r"bad pipeline spec: unterminated quoted value"):
        parse_spec('a{k="x,y}')


def test_option_without_value():
    with pytest.raises(ValueError, match=r"bad pipeline spec at character 3: expected '=' after option k of pass a"):
        parse_spec("a{k}")
    with pytest.raises(ValueError, match=r"expected '=' after option j of pass a"):
        parse_spec("a{k=1,j}")


@pytest.mark.parametrize("value", ["a,b", "1", "true", "none", "-3", "1e3", "", " x", "x y", "a}", "{", "a=b",
                                   'say "hi"', 'back\\"slash', "tab\there"])
def test_format_spec_round_trips_every_string(value):
    items = [("p", {"s": value})]
    spec = format_spec(items)
    assert spec.startswith('p{s="') and spec.endswith('"}'), spec  # each of these needs quotes
    assert parse_spec(spec) == items
    assert parse_spec(format_spec(items + [("q", {"t": value, "u": 1})])) == items + [("q", {"t": value, "u": 1})]


def test_format_spec_quotes_only_what_needs_it():
    assert format_spec([("p", {"s": "fp16", "t": "column_wise", "u": "a.b"})]) == "p{s=fp16,t=column_wise,u=a.b}"
    assert format_spec([("p", {"s": "a,b", "n": "2", "b": False})]) == 'p{s="a,b",n="2",b=false}'
    assert parse_spec('p{s="a,b",n="2",b=false}') == [("p", {"s": "a,b", "n": "2", "b": False})]


# ----------------------------------------------------------------------------- resolution errors

def test_unknown_pass(tiny):
    with pytest.raises(KeyError, match=r"unknown pass 'discover_table'; registered passes: .*discover_tables"):
        recc.compile(tiny, pipeline="discover_table,shard_tables")


def test_unknown_option(tiny):
    with pytest.raises(ValueError, match=r"pass shard_tables: unknown option\(s\) \['stratgy'\]; "
                                         r"options: \['access_profile', 'check_memory', 'constraints', 'strategy'\]"):
        recc.compile(tiny, pipeline="discover_tables,shard_tables{stratgy=auto}")


def test_option_on_a_pass_without_options(tiny):
    with pytest.raises(ValueError, match=r"pass discover_tables: unknown option\(s\) \['x'\]; options: none"):
        recc.compile(tiny, pipeline="discover_tables{x=1}")


def test_bad_spec_through_compile(tiny):
    with pytest.raises(ValueError, match="bad pipeline spec"):
        recc.compile(tiny, pipeline="discover_tables shard_tables")


@pytest.mark.parametrize("spec, late, early", [
    ("shard_tables,discover_tables", "shard_tables", "discover_tables"),
    ("discover_tables,batch_tables,shard_tables", "batch_tables", "shard_tables"),
])
def test_ordering_violation(tiny, spec, late, early):
    with pytest.raises(ValueError, match=rf"pass {late} must run after {early}, but the pipeline has it before"):
        recc.compile(tiny, pipeline=spec)


def test_pipeline_item_of_the_wrong_type(tiny):
    with pytest.raises(TypeError, match="neither a spec string nor a callable pass"):
        recc.compile(tiny, pipeline=["discover_tables", 42])


def test_pass_signature_is_checked():
    def positional_options(gm, ctx, strategy="auto"):
        return gm
    with pytest.raises(TypeError, match=r"option 'strategy' must be keyword-only"):
        recc.register_pass(positional_options)

    def no_ctx(gm):
        return gm
    with pytest.raises(TypeError, match=r"signature must be \(gm, ctx, \*, option=default, ...\)"):
        recc.register_pass(no_ctx)


# ----------------------------------------------------------------------------- disable / options

def test_disable(tiny):
    program = recc.compile(tiny, disable=("lower", "cache_tables", "quantize_comm", "pipeline_comm", "fuse_gathers", "fold_column_cat", "align_linear",
                                          "fuse_linear_act"))
    assert list(program.stages) == ["trace", "discover_tables", "shard_tables", "batch_tables", "insert_comm",
                                    "fuse_interaction"]
    assert program.pipeline == "discover_tables,shard_tables{strategy=auto},batch_tables,insert_comm,fuse_interaction"
    assert "[cpu]" not in program.stages["fuse_interaction"].text
    assert program.stages["fuse_interaction"].banner.startswith("# recc IR after [5/5] fuse_interaction")
    program = recc.compile(tiny, disable=("insert_comm", "cache_tables", "quantize_comm", "pipeline_comm", "fuse_gathers",
                                          "fuse_interaction", "fold_column_cat", "align_linear", "fuse_linear_act", "lower"))
    assert list(program.stages) == ["trace", "discover_tables", "shard_tables", "batch_tables"]
    assert program.pipeline == "discover_tables,shard_tables{strategy=auto},batch_tables"
    assert "torch.bmm(stack, transpose)" in program.stages["batch_tables"].text
    assert program.stages["batch_tables"].banner.startswith("# recc IR after [3/3] batch_tables")


def test_disable_an_unknown_pass(tiny):
    with pytest.raises(ValueError, match=r"disable names unknown pass\(es\) \['lowr'\]"):
        recc.compile(tiny, disable=("lowr",))


def test_config_pass_options_reach_the_pass(tiny):
    config = recc.CompileConfig(pass_options={"batch_tables": {"max_tables_per_group": 1}})
    program = recc.compile(tiny, config=config)
    assert program.stats["groups"] == 3
    assert program.stages["batch_tables"].spec == "batch_tables{max_tables_per_group=1}"
    assert "batch_tables{max_tables_per_group=1}" in program.pipeline


def test_spec_options_override_config_options(tiny):
    config = recc.CompileConfig(pass_options={"batch_tables": {"max_tables_per_group": 1}})
    program = recc.compile(tiny, config=config,
                           pipeline="discover_tables,shard_tables,batch_tables{max_tables_per_group=2}")
    assert program.stats["groups"] == 2


def test_unknown_option_in_config_pass_options(tiny):
    config = recc.CompileConfig(pass_options={"batch_tables": {"max_tables": 1}})
    with pytest.raises(ValueError, match=r"pass batch_tables: unknown option\(s\) \['max_tables'\]"):
        recc.compile(tiny, config=config)


def test_options_resolve_defaults_config_spec():
    config = recc.CompileConfig(pass_options={"lower": {"device": "cuda"}})
    resolved = resolve_pipeline("discover_tables,lower", config)
    assert [(i.name, o) for i, o in resolved] == [("discover_tables", {}), ("lower", {"device": "cuda"})]
    resolved = resolve_pipeline("lower{device=cpu}", config)
    assert resolved[0][1] == {"device": "cpu"}


@pytest.mark.parametrize("spec, match", [
    ("discover_tables,shard_tables,batch_tables{max_tables_per_group=abc}",
     r"pass batch_tables: option max_tables_per_group='abc' should be a int \(default 0\)"),
    ("discover_tables,shard_tables,batch_tables{max_tables_per_group=1.5}",
     r"option max_tables_per_group=1.5 should be a int"),
    ('discover_tables,shard_tables,batch_tables{max_tables_per_group="2"}',
     r"option max_tables_per_group='2' should be a int"),
    ("discover_tables,shard_tables{strategy=1}",
     r"pass shard_tables: option strategy=1 should be a str \(default 'auto'\)"),
])
def test_option_values_are_type_checked(tiny, spec, match):
    with pytest.raises(ValueError, match=match):
        recc.compile(tiny, pipeline=spec)


def test_option_types_from_config_pass_options_are_checked_too():
    config = recc.CompileConfig(pass_options={"batch_tables": {"max_tables_per_group": "2"}})
    with pytest.raises(ValueError, match=r"pass batch_tables: option max_tables_per_group='2' should be a int"):
        resolve_pipeline("discover_tables,shard_tables,batch_tables", config)


def test_a_quoted_string_reaches_the_pass_as_a_string(tiny):
    """A string that reads as another type is quoted; the pass then sees (and validates) the string."""
    with pytest.raises(ValueError, match=r"shard_tables: strategy '1' is not 'auto' or one of"):
        recc.compile(tiny, pipeline='discover_tables,shard_tables{strategy="1"}')


def test_an_int_is_accepted_for_a_float_option():
    @recc.register_pass(name="scale_for_test")
    def scale(gm, ctx, *, factor: float = 1.0):
        return gm
    try:
        (_, opts), = resolve_pipeline("scale_for_test{factor=2}", recc.CompileConfig())
        assert opts == {"factor": 2}
        with pytest.raises(ValueError, match=r"option factor='x' should be a float"):
            resolve_pipeline("scale_for_test{factor=x}", recc.CompileConfig())
    finally:
        del PASSES["scale_for_test"]


def test_sharding_from_the_config_shows_in_the_stage_spec(tiny):
    program = recc.compile(tiny, config=recc.CompileConfig(sharding="column_wise"))
    stage = program.stages["shard_tables"]
    assert stage.spec == "shard_tables{strategy=column_wise}"
    assert stage.banner.startswith("# recc IR after [2/")
    assert " shard_tables{strategy=column_wise} | " in stage.banner
    assert "shard_tables{strategy=column_wise}" in program.pipeline
    assert program.plan.strategy == "column_wise"
    assert {s.kind for s in program.plan.shards.values()} == {"column_wise"}
    assert "shard=cw@r0[" in stage.text


def test_options_from_config_fields_yield_to_pass_options_and_the_spec():
    assert PASSES["shard_tables"].from_config == {"strategy": "sharding"}
    rest = {"constraints": None, "check_memory": True, "access_profile": None}  # shard_tables' other options, at their defaults
    config = recc.CompileConfig(sharding="row_wise")
    (info, opts), = resolve_pipeline("shard_tables", config)
    assert opts == {"strategy": "row_wise", **rest}
    assert shown_options(info, opts) == {"strategy": "row_wise"}
    (_, opts), = resolve_pipeline("shard_tables{strategy=column_wise}", config)
    assert opts == {"strategy": "column_wise", **rest}
    both = recc.CompileConfig(sharding="row_wise", pass_options={"shard_tables": {"strategy": "data_parallel"}})
    (_, opts), = resolve_pipeline("shard_tables", both)
    assert opts == {"strategy": "data_parallel", **rest}
    (info, opts), = resolve_pipeline("shard_tables", recc.CompileConfig())
    assert opts == {"strategy": "auto", **rest}
    # A config-set option shows even at its default value; other options only when they differ.
    assert shown_options(info, opts) == {"strategy": "auto"}
    assert shown_options(info, {**opts, "check_memory": False}) == {"strategy": "auto", "check_memory": False}


def test_a_user_pass_can_take_an_option_from_the_config():
    @recc.register_pass(name="lr_for_test", from_config={"rate": "lr"})
    def lr_pass(gm, ctx, *, rate: float = 0.0, other: int = 1):
        return gm
    try:
        (info, opts), = resolve_pipeline("lr_for_test", recc.CompileConfig(lr=0.25))
        assert info.from_config == {"rate": "lr"}
        assert opts == {"rate": 0.25, "other": 1}
    finally:
        del PASSES["lr_for_test"]


def test_from_config_must_name_an_option():
    def typo(gm, ctx, *, strategy: str = "auto"):
        return gm
    with pytest.raises(TypeError, match=r"pass typo: from_config names 'stratgy', which is not one of its options"):
        recc.register_pass(typo, from_config={"stratgy": "sharding"})
    assert "typo" not in PASSES


# ----------------------------------------------------------------------------- user passes

@recc.register_pass(after=("shard_tables",))
def tag_tables_for_test(gm, ctx: recc.PassContext, *, note: str = "hello", times: int = 1):
    """Adds one harmless node after every table lookup and records what it saw."""
    ctx.stats["tag_tables_for_test"] = {"note": note, "times": times, "passes_run": list(ctx.passes_run),
                                        "world_size": ctx.cluster.world_size}
    for n in list(gm.graph.nodes):
        if "recc.table" in n.meta:
            with gm.graph.inserting_after(n):
                gm.graph.call_function(torch.Tensor.clone, (n,))
    return gm


def count_nodes_callable(gm, ctx):
    ctx.stats["count_nodes_callable"] = len(gm.graph.nodes)
    return None  # returning None keeps the graph it was given


def test_registered_user_pass_by_name(tiny):
    assert "tag_tables_for_test" in PASSES
    program = recc.compile(tiny, pipeline="discover_tables,shard_tables,tag_tables_for_test{note=hi,times=3},"
                                           "batch_tables,lower")
    assert list(program.stages) == ["trace", "discover_tables", "shard_tables", "tag_tables_for_test",
                                    "batch_tables", "lower"]
    stage = program.stages["tag_tables_for_test"]
    assert stage.spec == "tag_tables_for_test{note=hi,times=3}"
    assert program.stats["tag_tables_for_test"] == {"note": "hi", "times": 3,
                                                   "passes_run": ["discover_tables", "shard_tables"],
                                                   "world_size": 1}
    added = [n for n in stage.graph.graph.nodes if n.meta.get("recc.pass") == "tag_tables_for_test"]
    assert [n.name for n in added] == ["clone", "clone_1", "clone_2"]
    assert stage.text.count("  # @tag_tables_for_test") == 3
    assert stage.nodes_after - stage.nodes_before == 3


def test_registered_user_pass_respects_after(tiny):
    with pytest.raises(ValueError, match="pass tag_tables_for_test must run after shard_tables"):
        recc.compile(tiny, pipeline="discover_tables,tag_tables_for_test,shard_tables")


def test_user_pass_as_a_plain_callable(tiny):
    program = recc.compile(tiny, pipeline=["discover_tables", count_nodes_callable, "shard_tables",
                                           tag_tables_for_test, "batch_tables"])
    assert list(program.stages) == ["trace", "discover_tables", "count_nodes_callable", "shard_tables",
                                    "tag_tables_for_test", "batch_tables"]
    assert program.stats["count_nodes_callable"] == 29
    assert program.stages["count_nodes_callable"].diff == ""
    assert program.stages["tag_tables_for_test"].spec == "tag_tables_for_test"  # options at their defaults
    assert program.stats["tag_tables_for_test"]["note"] == "hello"
    assert program.stats["tag_tables_for_test"]["times"] == 1
    assert program.pipeline == ("discover_tables,count_nodes_callable,shard_tables{strategy=auto},"
                                "tag_tables_for_test,batch_tables")
    assert "count_nodes_callable" not in PASSES  # a callable is not registered by being used


def test_callable_with_options_as_a_tuple(tiny):
    program = recc.compile(tiny, pipeline=["discover_tables", "shard_tables", (tag_tables_for_test, {"times": 7})])
    assert program.stats["tag_tables_for_test"]["times"] == 7


def test_user_pass_nodes_keep_their_tag_through_later_passes(tiny):
    program = recc.compile(tiny, pipeline="discover_tables,shard_tables,tag_tables_for_test,batch_tables,lower")
    final = program.stages["lower"].graph
    tags = {n.name: n.meta.get("recc.pass") for n in final.graph.nodes}
    assert tags["clone"] == "tag_tables_for_test"
    assert tags["pooled_g0"] == "batch_tables"
    assert tags["bot_l_0"] is None  # user code is not tagged


def test_same_pass_twice_gets_two_stages(tiny):
    program = recc.compile(tiny, pipeline=["discover_tables", count_nodes_callable, count_nodes_callable])
    assert list(program.stages) == ["trace", "discover_tables", "count_nodes_callable", "count_nodes_callable#3"]


# ----------------------------------------------------------------------------- print_after

def test_print_after_names(tiny, capsys):
    program = recc.compile(tiny, print_after="discover_tables,lower")
    err = capsys.readouterr().err
    assert err == program.stages["discover_tables"].ir + "\n" + program.stages["lower"].ir + "\n"


def test_print_after_a_user_pass(tiny, capsys):
    program = recc.compile(tiny, pipeline=["discover_tables", count_nodes_callable],
                           print_after=["count_nodes_callable"])
    assert capsys.readouterr().err == program.stages["count_nodes_callable"].ir + "\n"


def test_bool_is_not_accepted_for_an_int_option(tiny):
    with pytest.raises(ValueError, match="max_tables_per_group=True should be a int"):
        recc.compile(tiny, pipeline="discover_tables,shard_tables,batch_tables{max_tables_per_group=true}")


def test_groups_are_emitted_in_order():
    import torch.nn as nn

    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.a = nn.EmbeddingBag(5, 2)
            self.b = nn.EmbeddingBag(5, 3)
            self.c = nn.EmbeddingBag(5, 4)

        def forward(self, o, i):
            return self.a(i[0], o[0]).sum() + self.b(i[1], o[1]).sum() + self.c(i[2], o[2]).sum()

    ex = [[torch.arange(2)] * 3, [torch.tensor([1, 2])] * 3]
    program = recc.compile(M(), example_inputs=ex)
    groups = [n.target for n in program.graph.graph.nodes if n.op == "get_attr" and n.target.startswith("tbe_")]
    assert groups == ["tbe_g0", "tbe_g1", "tbe_g2"]


# ----------------------------------------------------------------------------- the default pipeline

def test_the_default_pipeline_runs_a_conditional_pass_where_its_condition_holds(tiny):
    from recc.passmanager import DEFAULT_PASSES, default_pipeline
    assert recc.DEFAULT_PIPELINE == ",".join(n for n in DEFAULT_PASSES if PASSES[n].when is None)
    gm = recc.compile(tiny, pipeline="discover_tables").stages["trace"].graph
    fp32, bf16 = recc.CompileConfig(), recc.CompileConfig(dense_dtype="bf16")
    assert default_pipeline(fp32, recc.Cluster.local(2), gm) == recc.DEFAULT_PIPELINE
    assert default_pipeline(bf16, recc.Cluster.local(1), gm) == \
        recc.DEFAULT_PIPELINE.replace(",lower", ",cast_dense,cast_embeddings,lower")


def test_compiler_names_no_pass():
    """What a pass needs from the compile (its condition, verification's tolerance) is declared
    where it is registered: no built-in pass's name appears in compiler.py's code."""
    import ast
    import inspect

    import recc.compiler
    tree = ast.parse(inspect.getsource(recc.compiler))
    named = {node.value for node in ast.walk(tree) if isinstance(node, ast.Constant) and node.value in PASSES}
    assert not named


def _require_for_test(config, cluster, gm):
    return config.init_seed == 424242


@recc.register_pass(from_config={"seed": "init_seed"}, when=_require_for_test, required=True, tolerance=0.5)
def required_for_test(gm, ctx, *, seed: int = 0):
    return gm


def test_a_required_pass_missing_where_its_condition_holds_is_an_error(tiny):
    with pytest.raises(ValueError, match=r"CompileConfig\(init_seed=424242\) needs the required_for_test pass, "
                                         r"which the pipeline does not run; add it to the pipeline"):
        recc.compile(tiny, pipeline="discover_tables", config=recc.CompileConfig(init_seed=424242))
    recc.compile(tiny, pipeline="discover_tables", config=recc.CompileConfig(init_seed=7))  # condition false: fine


def test_required_needs_a_condition():
    def always(gm, ctx):
        return gm
    with pytest.raises(TypeError, match=r"pass always: required=True needs the condition \(when=\)"):
        recc.register_pass(always, required=True)
    assert "always" not in PASSES


def test_a_pass_tolerance_loosens_verification_from_it_on_where_its_condition_holds(tiny, monkeypatch):
    from recc import ir
    seen = []
    verify = ir.verify

    def spy(gm, *, pass_name="?", **kw):
        seen.append((pass_name, kw.get("tolerance")))
        return verify(gm, pass_name=pass_name, **kw)
    monkeypatch.setattr(ir, "verify", spy)
    spec = "discover_tables,required_for_test,shard_tables"
    recc.compile(tiny, pipeline=spec, config=recc.CompileConfig(init_seed=424242))
    assert seen == [("trace", None), ("discover_tables", 1e-4), ("required_for_test", 0.5), ("shard_tables", 0.5)]
    seen.clear()
    recc.compile(tiny, pipeline=spec, config=recc.CompileConfig(init_seed=7))
    assert seen == [("trace", None), ("discover_tables", 1e-4), ("required_for_test", 1e-4), ("shard_tables", 1e-4)]


def test_compile_leaves_the_cycle_collector_as_it_found_it(tiny, monkeypatch):
    """Collection is off while compiling (a full collection walks every stage's objects) and back
    to the caller's setting after, also when the compile fails."""
    import gc
    seen = []
    monkeypatch.setattr(recc.ir, "verify", lambda gm, **kw: seen.append(gc.isenabled()))
    assert gc.isenabled()
    recc.compile(tiny, pipeline="discover_tables")
    assert seen == [False, False] and gc.isenabled()
    with pytest.raises(KeyError):
        recc.compile(tiny, pipeline="no_such_pass")
    assert gc.isenabled()
    gc.disable()
    try:
        recc.compile(tiny, pipeline="discover_tables")
        assert not gc.isenabled()
    finally:
        gc.enable()
