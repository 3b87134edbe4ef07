"""TF_CONFIG validation and cluster resolvers: each error names the field and the value."""

import json

import pytest

from tfdist.cluster import ClusterSpec, TaskSpec, resolve_cluster

W2 = ["127.0.0.1:2222", "127.0.0.1:2223"]


def _env(config):
    return {"TF_CONFIG": config if isinstance(config, str) else json.dumps(config)}


# Each TF_CONFIG error case: (TF_CONFIG, fragments the message must contain).
BAD_TF_CONFIGS = {
    "malformed_json": ('{"cluster": {"worker": ["127.0.0.1:2222"]', ["not valid JSON",
                                                                    "Received:",
                                                                    '"worker"']),
    "unknown_task_type_in_cluster": ({"cluster": {"worker": W2, "master": ["h:1"]}},
                                     ["unknown task type", "'master'", "TF_CONFIG.cluster"]),
    "unknown_task_type_in_task": ({"cluster": {"worker": W2},
                                   "task": {"type": "boss", "index": 0}},
                                  ["TF_CONFIG.task.type", "type='boss'"]),
    "index_out_of_range": ({"cluster": {"worker": W2}, "task": {"type": "worker", "index": 2}},
                           ["out of range", "2 'worker' task(s)", "'index': 2"]),
    "negative_index": ({"cluster": {"worker": W2}, "task": {"type": "worker", "index": -1}},
                       ["task index", "index=-1"]),
    "task_type_not_in_cluster": ({"cluster": {"worker": W2},
                                  "task": {"type": "chief", "index": 0}},
                                 ["out of range", "0 'chief' task(s)"]),
    "duplicate_address": ({"cluster": {"chief": ["127.0.0.1:2222"], "worker": W2}},
                          ["duplicate address", "'127.0.0.1:2222'", "chief-0", "worker-0"]),
    "no_worker": ({"cluster": {"ps": ["127.0.0.1:2222"]}},
                  ["at least one worker", "'ps': ['127.0.0.1:2222']"]),
    "empty_cluster": ({"cluster": {}}, ["at least one worker", "cluster={}"]),
    "two_chiefs": ({"cluster": {"chief": ["h:1", "h:2"], "worker": W2}},
                   ["at most one chief", "chief=['h:1', 'h:2']"]),
    "bad_address": ({"cluster": {"worker": ["127.0.0.1"]}},
                    ["cluster.worker", "host:port", "'127.0.0.1'"]),
    "cluster_not_an_object": ({"cluster": ["h:1"]}, ["TF_CONFIG.cluster", "['h:1']"]),
    "not_an_object": ("[1, 2]", ["JSON object", "[1, 2]"]),
    "sparse_index_signed": ({"cluster": {"worker": {"-0": "h:1", "1": "h:2"}}},
                            ["TF_CONFIG.cluster.worker", "index '-0'"]),
    "sparse_index_padded": ({"cluster": {"worker": {"00": "h:1", "1": "h:2"}}},
                            ["TF_CONFIG.cluster.worker", "index '00'"]),
    "sparse_index_gap": ({"cluster": {"worker": {"0": "h:1", "2": "h:2"}}},
                         ["0..n-1", "indices [0, 2]"]),
    "deeply_nested_json": ("[" * 100_000 + "]" * 100_000, ["nested too deeply"]),
    "deeply_nested_cluster": ('{"cluster": {"worker": ' + "[" * 100_000 + "]" * 100_000 + "}}",
                              ["nested too deeply"]),
    "loopback_duplicate": ({"cluster": {"worker": ["localhost:2222", "127.0.0.1:2222"]}},
                           ["duplicate address", "'127.0.0.1:2222'", "'localhost:2222'",
                            "worker-0", "worker-1"]),
}


@pytest.mark.unit
@pytest.mark.parametrize("case", sorted(BAD_TF_CONFIGS))
def test_bad_tf_config_names_field_and_value(case):
    config, fragments = BAD_TF_CONFIGS[case]
    with pytest.raises(ValueError) as info:
        ClusterSpec.from_env(_env(config))
    for fragment in fragments:
        assert fragment in str(info.value), (case, str(info.value))


@pytest.mark.unit
@pytest.mark.parametrize("value", [None, ""])
def test_tf_config_not_set(value):
    environ = {} if value is None else {"TF_CONFIG": value}
    with pytest.raises(ValueError, match=r"TF_CONFIG is not set.*Received: TF_CONFIG="):
        ClusterSpec.from_env(environ)


@pytest.mark.unit
def test_good_tf_config_round_trips():
    config = {"cluster": {"chief": ["10.0.0.1:2222"], "worker": W2}, "task": {"type": "worker",
                                                                              "index": 1}}
    spec = ClusterSpec.from_env(_env(config))
    assert spec.task == TaskSpec("worker", 1) and spec.num_workers == 3
    assert not spec.is_chief() and spec.with_task("chief").is_chief()
    assert json.loads(spec.to_tf_config()) == config
    assert ClusterSpec.from_json(spec.to_tf_config()) == spec


@pytest.mark.unit
def test_resolve_cluster_from_env_spec_and_dict(monkeypatch):
    config = {"cluster": {"worker": W2}, "task": {"type": "worker", "index": 0}}
    monkeypatch.setenv("TF_CONFIG", json.dumps(config))
    spec = resolve_cluster(None)
    assert spec == resolve_cluster("env") == resolve_cluster(config) == resolve_cluster(spec)
    monkeypatch.delenv("TF_CONFIG")
    with pytest.raises(ValueError, match="TF_CONFIG is not set"):
        resolve_cluster(None)
    with pytest.raises(ValueError, match="Received: 42"):
        resolve_cluster(42)


def test_resolve_tf_simple_and_tf_config_resolvers(monkeypatch):
    import tensorflow as tf

    spec = ClusterSpec(worker=tuple(W2), task=TaskSpec("worker", 1))
    assert resolve_cluster(spec.to_cluster_resolver()) == spec
    monkeypatch.setenv("TF_CONFIG", spec.to_tf_config())
    assert resolve_cluster(tf.distribute.cluster_resolver.TFConfigClusterResolver()) == spec


def test_resolve_tf_slurm_resolver(monkeypatch):
    import tensorflow as tf

    for key, value in {"SLURM_PROCID": "2", "SLURM_STEP_NUM_TASKS": "3",
                       "SLURM_STEP_NODELIST": "node[1-2]",
                       "SLURM_STEP_TASKS_PER_NODE": "2,1"}.items():
        monkeypatch.setenv(key, value)
    # TF's resolver divides by gpus_per_task, so it cannot describe CPU-only nodes
    # (tfdist's own "slurm" source can); GPUs here are only counted, never used.
    resolver = tf.distribute.cluster_resolver.SlurmClusterResolver(
        port_base=9000, gpus_per_node=2, gpus_per_task=1, auto_set_gpu=False)
    spec = resolve_cluster(resolver)
    assert spec.worker == ("node1:9000", "node1:9001", "node2:9000")
    assert spec.task == TaskSpec("worker", 2)


def test_resolve_tf_kubernetes_resolver():
    import types

    import tensorflow as tf

    def pod(name, ip):
        return types.SimpleNamespace(metadata=types.SimpleNamespace(name=name),
                                     status=types.SimpleNamespace(phase="Running", host_ip=ip))

    class FakeClient:
        def list_pod_for_all_namespaces(self, label_selector):
            assert label_selector == "job-name=trainer"
            return types.SimpleNamespace(items=[pod("b", "10.0.0.2"), pod("a", "10.0.0.1")])

    resolver = tf.distribute.cluster_resolver.KubernetesClusterResolver(
        {"worker": ["job-name=trainer"]}, override_client=FakeClient())
    resolver.task_type, resolver.task_id = "worker", 1
    spec = resolve_cluster(resolver)
    assert spec.worker == ("10.0.0.1:8470", "10.0.0.2:8470")
    assert spec.task == TaskSpec("worker", 1) and not spec.is_chief()


@pytest.mark.parametrize("kwargs,match", [
    ({"cluster_resolver": ClusterSpec(worker=tuple(W2), ps=("127.0.0.1:2224",),
                                      task=TaskSpec("ps", 0))}, r"Received: task='ps-0'"),
    ({"cluster_resolver": ClusterSpec(worker=tuple(W2))}, r"Received: cluster=.*task=None"),
    ({"cluster_resolver": ClusterSpec(worker=tuple(W2), task=TaskSpec("worker", 0)),
      "startup_timeout": 0}, r"Received: startup_timeout=0"),
    ({"cluster_resolver": ClusterSpec(worker=tuple(W2), task=TaskSpec("worker", 0)),
      "collective_timeout": -1}, r"Received: collective_timeout=-1"),
    ({"cluster_resolver": "nonsense"}, r"Received: 'nonsense'"),
])
def test_strategy_rejects_bad_cluster_before_starting_tf(kwargs, match):
    """These fail in the constructor before TF starts a server or a context."""
    from tfdist.strategies.multi_worker import MultiWorkerMirroredStrategy

    with pytest.raises(ValueError, match=match):
        MultiWorkerMirroredStrategy(**kwargs)
