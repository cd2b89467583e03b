"""CompileConfig (code and YAML) and Cluster (local, YAML, torchrun environment)."""
from __future__ import annotations

import dataclasses
import re

import pytest
import yaml

import recc
from recc.specs import OptimizerSpec


# ----------------------------------------------------------------------------- CompileConfig

def test_config_defaults():
    c = recc.CompileConfig()
    assert (c.optimizer, c.lr, c.eps, c.sharding, c.verify, c.batch_size, c.pass_options) == \
        ("sgd", 0.01, 1e-8, "auto", 1, None, {})
    assert c.sparse_optimizer == OptimizerSpec("sgd", 0.01, 1e-8, 0.9, 0.999, 0.0)


def test_config_from_code():
    c = recc.CompileConfig(optimizer="rowwise_adagrad", lr=0.05, sharding="row_wise", comm_fwd="bf16",
                           comm_bwd="fp32", pipelining=False, batch_size=64, verify=2,
                           pass_options={"batch_tables": {"max_tables_per_group": 4}})
    assert c.sparse_optimizer.name == "rowwise_adagrad" and c.sparse_optimizer.lr == 0.05
    assert c.sparse_optimizer.describe() == "rowwise_adagrad(lr=0.05)"
    assert c.pass_options["batch_tables"]["max_tables_per_group"] == 4


def test_config_from_yaml(tmp_path):
    path = tmp_path / "train.yaml"
    path.write_text("optimizer: adagrad\nlr: 0.2\neps: 1.0e-6\nsharding: table_wise\nbatch_size: 16\n"
                    "pass_options:\n  batch_tables:\n    max_tables_per_group: 2\n")
    c = recc.CompileConfig.from_yaml(path)
    assert (c.optimizer, c.lr, c.eps, c.sharding, c.batch_size) == ("adagrad", 0.2, 1e-6, "table_wise", 16)
    assert c.pass_options == {"batch_tables": {"max_tables_per_group": 2}}
    assert recc.CompileConfig.from_yaml(str(path)) == c


def test_empty_yaml_is_the_default_config(tmp_path):
    path = tmp_path / "empty.yaml"
    path.write_text("")
    assert recc.CompileConfig.from_yaml(path) == recc.CompileConfig()


def test_config_yaml_round_trip():
    c = recc.CompileConfig(optimizer="adam", lr=0.003, batch_size=32,
                           pass_options={"shard_tables": {"strategy": "row_wise"}})
    assert recc.CompileConfig.from_dict(yaml.safe_load(c.to_yaml())) == c
    assert c.to_dict() == dataclasses.asdict(c)


def test_config_unknown_key(tmp_path):
    with pytest.raises(ValueError, match=r"CompileConfig: unknown keys \['learning_rate'\]; known: \[.*'lr'"):
        recc.CompileConfig.from_dict({"learning_rate": 0.1})
    path = tmp_path / "typo.yaml"
    path.write_text("optimiser: sgd\n")
    with pytest.raises(ValueError, match=r"unknown keys \['optimiser'\]"):
        recc.CompileConfig.from_yaml(path)


@pytest.mark.parametrize("kwargs, match", [
    ({"optimizer": "lamb"}, r"CompileConfig.optimizer='lamb': choose one of \('sgd', 'rowwise_adagrad', 'adagrad', 'adam'\)"),
    ({"sharding": "diagonal"}, r"CompileConfig.sharding='diagonal': choose 'auto' or one of"),
    ({"comm_fwd": "fp4"}, r"CompileConfig.comm_fwd='fp4': choose one of"),
    ({"verify": 3}, r"CompileConfig.verify=3: choose 0, 1 or 2"),
    ({"lr": 0.0}, r"CompileConfig.lr must be > 0"),
    ({"batch_size": 0}, r"CompileConfig.batch_size must be >= 1"),
])
def test_config_bad_values(kwargs, match):
    with pytest.raises(ValueError, match=match):
        recc.CompileConfig(**kwargs)
    with pytest.raises(ValueError, match=match):
        recc.CompileConfig.from_dict(kwargs)


def test_bad_optimizer_in_yaml(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("optimizer: Adam\n")
    with pytest.raises(ValueError, match=r"CompileConfig.optimizer='Adam'"):
        recc.CompileConfig.from_yaml(path)


def test_compile_takes_config_as_object_dict_or_yaml(tiny, tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("optimizer: rowwise_adagrad\nlr: 0.5\n")
    for config in (recc.CompileConfig(optimizer="rowwise_adagrad", lr=0.5),
                   {"optimizer": "rowwise_adagrad", "lr": 0.5}, str(path), path):
        program = recc.compile(tiny, config=config, pipeline="discover_tables,shard_tables,batch_tables")
        assert program.config.sparse_optimizer.name == "rowwise_adagrad"
        assert "dim=4 sum rowwise_adagrad(lr=0.5)" in program.stages["batch_tables"].text


def test_config_batch_size_sets_the_example_batch(tiny):
    program = recc.compile(tiny, config=recc.CompileConfig(batch_size=5), pipeline="discover_tables")
    text = program.stages["discover_tables"].text
    assert text.splitlines()[0] == "dense_x    : f32[5,13]    = input"
    assert "emb_l_0    : f32[5,4]     = recc.embedding_bag(" in text


def test_recc_verify_does_not_mutate_the_callers_config(tiny, monkeypatch):
    config = recc.CompileConfig()
    monkeypatch.setenv("RECC_VERIFY", "0")
    program = recc.compile(tiny, config=config, pipeline="discover_tables")
    assert config.verify == 1
    # The override applies to that compilation (a copy of the config) and to nothing later.
    assert program.config.verify == 0 and program.config is not config
    assert program.stages["discover_tables"].banner.endswith("| verify off")
    monkeypatch.delenv("RECC_VERIFY")
    again = recc.compile(tiny, config=config, pipeline="discover_tables")
    assert again.config.verify == 1
    assert again.stages["discover_tables"].banner.endswith("| verify ok")


@pytest.mark.parametrize("value, match", [
    ("3", r"CompileConfig.verify=3: choose 0, 1 or 2"),
    ("yes", r"RECC_VERIFY='yes': expected 0, 1 or 2"),
])
def test_recc_verify_is_validated(tiny, monkeypatch, value, match):
    config = recc.CompileConfig()
    monkeypatch.setenv("RECC_VERIFY", value)
    with pytest.raises(ValueError, match=match):
        recc.compile(tiny, config=config, pipeline="discover_tables")
    assert config.verify == 1


# ----------------------------------------------------------------------------- Cluster

def test_cluster_local():
    c = recc.Cluster.local(2)
    assert (c.name, c.world_size, c.nodes, c.devices_per_node) == ("local-2", 2, 1, 2)
    assert (c.device_type, c.backend) == ("cpu", "gloo")
    assert recc.Cluster.local() == recc.Cluster.local(1)
    gpu = recc.Cluster.local(4, device="cuda")
    assert (gpu.device_type, gpu.backend, gpu.device.is_gpu) == ("cuda", "nccl", True)


def test_cluster_local_bad_world():
    with pytest.raises(ValueError, match="world_size must be >= 1, got 0"):
        recc.Cluster.local(0)
    with pytest.raises(ValueError, match="6 ranks cannot form 4 equal nodes"):
        recc.Cluster.local(6, nodes=4)


def test_cluster_local_emulated_nodes():
    c = recc.Cluster.local(4, nodes=2)
    assert (c.name, c.world_size, c.nodes, c.devices_per_node, c.single_host) == ("local-2x2", 4, 2, 2, True)
    assert [list(c.node_ranks(n)) for n in range(2)] == [[0, 1], [2, 3]]
    assert c.link(0, 1) == c.intra_node and c.link(1, 2) == c.inter_node
    # Only clusters that say so run on this host; a description of real nodes does not.
    assert recc.Cluster.local(2).single_host
    assert not recc.Cluster.from_dict({"nodes": 2, "devices_per_node": 2}).single_host
    assert recc.Cluster.from_dict({"nodes": 2, "devices_per_node": 2, "single_host": True}).single_host


ZIONEX = """\
nodes: 2
devices_per_node: 8
device: {kind: a100, memory_gb: 80, mem_bw_gbps: 2039}
intra_node: {bw_gbps: 300, latency_us: 2}
inter_node: {bw_gbps: 25, latency_us: 10}
"""


def test_cluster_from_yaml(tmp_path):
    path = tmp_path / "zionex-2x8.yaml"
    path.write_text(ZIONEX)
    c = recc.Cluster.from_yaml(path)
    assert c.name == "zionex-2x8"  # the file's stem when the YAML has no name
    assert (c.world_size, c.nodes, c.devices_per_node) == (16, 2, 8)
    assert c.device == recc.DeviceSpec("a100", 80, 2039)
    assert c.intra_node == recc.LinkSpec(300, 2) and c.inter_node == recc.LinkSpec(25, 10)
    assert (c.backend, c.device_type) == ("nccl", "cuda")
    assert [c.node_of(r) for r in (0, 7, 8, 15)] == [0, 0, 1, 1]
    assert recc.Cluster.from_dict(c.to_dict()) == c


def test_cluster_yaml_name_wins(tmp_path):
    path = tmp_path / "file.yaml"
    path.write_text("name: lab\nnodes: 1\ndevices_per_node: 2\n")
    c = recc.Cluster.from_yaml(path)
    assert (c.name, c.world_size, c.device.kind) == ("lab", 2, "cpu")


def test_cluster_yaml_unknown_key(tmp_path):
    path = tmp_path / "typo.yaml"
    path.write_text("nodes: 2\ngpus_per_node: 8\n")
    with pytest.raises(ValueError, match=r"unknown keys \['gpus_per_node'\]"):
        recc.Cluster.from_yaml(path)


def test_cluster_yaml_bad_size(tmp_path):
    path = tmp_path / "zero.yaml"
    path.write_text("nodes: 0\n")
    with pytest.raises(ValueError, match=r"nodes \(0\) and devices_per_node \(1\) must be >= 1"):
        recc.Cluster.from_yaml(path)


@pytest.fixture
def no_torchrun_env(monkeypatch):
    for name in ("WORLD_SIZE", "LOCAL_WORLD_SIZE", "RANK", "LOCAL_RANK"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("RECC_DEVICE", "cpu")
    return monkeypatch


def test_cluster_from_env(no_torchrun_env):
    no_torchrun_env.setenv("WORLD_SIZE", "8")
    no_torchrun_env.setenv("LOCAL_WORLD_SIZE", "4")
    c = recc.Cluster.from_env()
    assert (c.name, c.world_size, c.nodes, c.devices_per_node, c.device_type) == ("env-2x4", 8, 2, 4, "cpu")


def test_cluster_from_env_single_node(no_torchrun_env):
    no_torchrun_env.setenv("WORLD_SIZE", "3")
    c = recc.Cluster.from_env()
    assert (c.name, c.nodes, c.devices_per_node) == ("env-1x3", 1, 3)


def test_cluster_from_env_outside_torchrun(no_torchrun_env):
    c = recc.Cluster.from_env()
    assert (c.name, c.world_size) == ("env-1x1", 1)


def test_cluster_from_env_inconsistent(no_torchrun_env):
    no_torchrun_env.setenv("WORLD_SIZE", "6")
    no_torchrun_env.setenv("LOCAL_WORLD_SIZE", "4")
    with pytest.raises(ValueError, match="WORLD_SIZE=6 is not a multiple of LOCAL_WORLD_SIZE=4"):
        recc.Cluster.from_env()


def test_optimizer_conventions_are_validated_and_reach_the_groups():
    import pytest
    import recc
    from recc.models import build_model
    with pytest.raises(ValueError, match="weight_decay_mode='adamw'"):
        recc.CompileConfig(weight_decay_mode="adamw")
    with pytest.raises(ValueError, match="adam_eps='torch'"):
        recc.CompileConfig(adam_eps="torch")
    cfg = recc.CompileConfig(optimizer="adam", weight_decay=0.01, weight_decay_mode="decoupled",
                             adam_eps="before_bias_correction")
    program = recc.compile(build_model("tiny"), config=cfg)
    assert "adam(lr=0.01, weight_decay=0.01 decoupled, eps before bias correction)" in program.stages["batch_tables"].text
    spec = cfg.sparse_optimizer
    assert spec.eps_at(1) == pytest.approx(cfg.eps / (1 - cfg.beta2) ** 0.5)
    assert recc.CompileConfig(optimizer="adam").sparse_optimizer.eps_at(1) == cfg.eps


@pytest.mark.parametrize("text, message", [
    ("device: {memory_gb: 40GB}", r"device\.memory_gb: expected a number, got '40GB' \(no units"),
    ("device: {memroy_gb: 4}", r"unknown keys \['device\.memroy_gb'\]; known: \['device\.kind', 'device\.memory_gb'"),
    ("nodes: two", r"nodes: expected an integer, got 'two'"),
    ("nodes: 1.5", r"nodes: expected an integer, got 1\.5"),
    ("intra_node: 5", r"intra_node: expected a mapping of \['bw_gbps', 'latency_us', 'message_us'\], got 5"),
    ("inter_node: {bw_gbps: 0}", r"inter_node: link: bw_gbps must be > 0"),
    ("single_host: yes please", r"single_host: expected true or false"),
    ("nodes: [", r"not valid YAML: "),
    ("- 1\n- 2", r"expected a mapping of cluster fields, got list"),
])
def test_cluster_yaml_errors_name_the_file_and_the_field(tmp_path, text, message):
    path = tmp_path / "lab.yaml"
    path.write_text(text + "\n")
    with pytest.raises(ValueError, match=re.escape(str(path)) + ": " + message) as e:
        recc.Cluster.from_yaml(path)
    assert "\n" not in str(e.value)


def test_shipped_clusters_are_found_by_name_from_any_directory(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert {"zionex-16x8", "dgx-h100-4x8", "local-2", "local-4"} <= set(recc.Cluster.shipped())
    c = recc.Cluster.from_yaml("zionex-16x8")
    assert (c.name, c.world_size, c.device.kind) == ("zionex-16x8", 128, "a100")
    with pytest.raises(ValueError, match=r"cluster 'zionex-16x9': no such file, and no cluster of that name ships "
                                         r"with recc \(shipped: dgx-h100-4x8, local-2, local-4, zionex-16x8\)"):
        recc.Cluster.from_yaml("zionex-16x9")
    with pytest.raises(ValueError, match=r"cluster file 'sub/lab.yaml' does not exist"):
        recc.Cluster.from_yaml("sub/lab.yaml")
