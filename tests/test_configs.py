"""configs/: every training config runs on small settings; the Kubernetes and Slurm
files are valid and produce an environment tfdist's resolver accepts."""

import json
import shlex
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

from tfdist.cli import build_parser
from tfdist.cluster import from_slurm
from tfdist.config import load_config

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = sorted((ROOT / "configs").glob("*.toml"))
SMALL = ["train.epochs=2", "data.limit=320", "train.global_batch_size=32", "train.verbose=2",
         "cluster.timeout=240"]


def _train(config, out, extra=()):
    sets = [*SMALL, f'train.output_dir="{out}"', *extra]
    if load_config(config)["train"]["steps_per_epoch"]:
        sets.append("train.steps_per_epoch=4")
    command = [sys.executable, "-m", "tfdist.cli", "train", str(config)]
    for item in sets:
        command += ["--set", item]
    return subprocess.run(command, capture_output=True, text=True, timeout=300, cwd=ROOT)


@pytest.mark.multiprocess
@pytest.mark.timeout(330)
@pytest.mark.parametrize("config", CONFIGS, ids=[c.stem for c in CONFIGS])
def test_training_config_runs(config, tmp_path):
    result = _train(config, tmp_path)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    report = json.loads((tmp_path / "report.json").read_text())
    for field in ("config", "strategy", "num_replicas", "epochs", "history", "final",
                  "wall_time_seconds", "bytes_communicated"):
        assert field in report, field
    assert report["epochs"] == 2 and len(report["history"]["loss"]) == 2
    assert 0.0 <= report["final"]["val_accuracy"] <= 1.0
    if report["config"]["strategy"]["name"] not in ("none", "parameter_server"):
        assert report["bytes_communicated"] > 0
    assert (tmp_path / "report.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert (tmp_path / "model.keras").stat().st_size > 0
    assert "Epoch 2/2" in result.stdout


@pytest.mark.unit
def test_kubernetes_tfjob_gives_an_accepted_tf_config():
    import yaml

    documents = list(yaml.safe_load_all((ROOT / "configs/kubernetes/tfjob.yaml").read_text()))
    job = next(d for d in documents if d["kind"] == "TFJob")
    replicas = job["spec"]["tfReplicaSpecs"]
    name = job["metadata"]["name"]
    # The TF_CONFIG the training operator writes into each pod.
    cluster = {role.lower(): [f"{name}-{role.lower()}-{i}.default.svc:2222"
                              for i in range(spec["replicas"])]
               for role, spec in replicas.items()}
    for role, addresses in cluster.items():
        for index in range(len(addresses)):
            with warnings.catch_warnings():
                warnings.simplefilter("error")  # cluster-internal names: no warning
                from tfdist.cluster import resolve_cluster

                spec = resolve_cluster({"cluster": cluster,
                                        "task": {"type": role, "index": index}})
            assert spec.num_workers == 2
    container = replicas["Worker"]["template"]["spec"]["containers"][0]
    args = build_parser().parse_args(container["command"][1:])
    config = load_config(ROOT / "configs" / Path(args.config).name, args.set)
    assert config["cluster"]["mode"] == "env"


@pytest.mark.multiprocess
def test_slurm_script_is_valid_and_its_environment_resolves():
    script = ROOT / "configs/slurm/multi_worker.sbatch"
    subprocess.run(["bash", "-n", str(script)], check=True)
    text = script.read_text()
    nodes = int(next(line.split("=")[1] for line in text.splitlines()
                     if line.startswith("#SBATCH --nodes=")))
    env = {"SLURM_PROCID": "1", "SLURM_STEP_NODELIST": f"node[01-{nodes:02d}]",
           "SLURM_STEP_TASKS_PER_NODE": f"1(x{nodes})"}
    spec = from_slurm(env)
    assert spec.worker == ("node01:8470", "node02:8470")
    assert spec.task.type == "worker" and spec.task.index == 1
    srun = text[text.index("\nsrun "):].replace("\\\n", " ")
    argv = shlex.split(srun.replace("${SLURM_JOB_ID:-local}", "1"))
    assert argv[-1] == "$@"  # the script's own arguments go to tfdist train
    args = build_parser().parse_args(argv[argv.index("train"):-1])
    config = load_config(ROOT / args.config, args.set)
    assert config["cluster"]["mode"] == "env"


@pytest.mark.multiprocess
@pytest.mark.timeout(330)
def test_compare_writes_one_table_and_one_plot(tmp_path):
    """The two configs as shipped (5 epochs of the digits each): mirrored.toml's CNN
    beats default.toml's MLP, so a newcomer comparing them does not conclude that
    mirrored training is broken (measured 0.9805 against 0.9582)."""
    command = [sys.executable, "-m", "tfdist.cli", "compare", "configs/default.toml",
               "configs/mirrored.toml", "--output", str(tmp_path)]
    result = subprocess.run(command, capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    summary = json.loads((tmp_path / "compare.json").read_text())
    assert [s["name"] for s in summary] == ["default", "mirrored"]
    default, mirrored = (s["final"]["val_accuracy"] for s in summary)
    assert mirrored > default, (mirrored, default)
    table = (tmp_path / "compare.md").read_text()
    assert "val_accuracy" in table and "bytes communicated" in table
    assert (tmp_path / "compare.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def _manifests():
    import yaml

    return list(yaml.safe_load_all((ROOT / "configs/kubernetes/tfjob.yaml").read_text()))


@pytest.mark.unit
def test_kubernetes_manifests_define_what_the_tfjob_references():
    documents = _manifests()
    for document in documents:
        assert document["apiVersion"] and document["kind"] and document["metadata"]["name"]
    by_kind = {d["kind"]: d for d in documents}
    assert set(by_kind) == {"ConfigMap", "PersistentVolumeClaim", "TFJob", "NetworkPolicy"}
    pod = by_kind["TFJob"]["spec"]["tfReplicaSpecs"]["Worker"]["template"]
    volumes = {v["name"]: v for v in pod["spec"]["volumes"]}
    assert volumes["config"]["configMap"]["name"] == by_kind["ConfigMap"]["metadata"]["name"]
    assert volumes["output"]["persistentVolumeClaim"]["claimName"] == \
        by_kind["PersistentVolumeClaim"]["metadata"]["name"]
    claim = by_kind["PersistentVolumeClaim"]["spec"]
    assert claim["accessModes"] and claim["resources"]["requests"]["storage"]
    container = pod["spec"]["containers"][0]
    assert container["name"] == "tensorflow"  # the name the training operator looks for
    mounts = {m["name"]: m["mountPath"] for m in container["volumeMounts"]}
    assert set(mounts) == set(volumes)
    # The config the command names is in the ConfigMap, equal to the repository's file.
    config_path = Path(container["command"][2])
    assert config_path.parent == Path(mounts["config"])
    data = by_kind["ConfigMap"]["data"]
    assert data[config_path.name] == (ROOT / "configs" / config_path.name).read_text()
    # The image is the one the Dockerfile's instructions build.
    assert f"-t {container['image']} ." in (ROOT / "Dockerfile").read_text()
    assert by_kind["NetworkPolicy"]["spec"]["podSelector"]["matchLabels"].items() <= \
        pod["metadata"]["labels"].items()


@pytest.mark.unit
def test_dockerfile_copies_what_exists_and_installs_the_package():
    text = (ROOT / "Dockerfile").read_text()
    lines = [line.strip() for line in text.splitlines() if line.strip()
             and not line.lstrip().startswith("#")]
    assert lines[0].startswith("FROM python:3.1")
    for line in lines:
        if line.startswith("COPY "):
            for source in line.split()[1:-1]:
                assert (ROOT / source).exists(), f"Dockerfile copies missing {source}"
    assert "RUN pip install ." in lines and "ARG HOROVOD=0" in lines
    assert "scripts/install_horovod.sh" in text
    ignored = (ROOT / ".dockerignore").read_text().split()
    assert ".venv" in ignored and ".git" in ignored


@pytest.mark.unit
def test_manifests_pass_the_kubernetes_schemas():
    """Offline schema validation (kubernetes-validate, strict: unknown fields fail). The
    TFJob is a custom resource: each of its pod templates is checked as a Pod."""
    kubernetes_validate = pytest.importorskip("kubernetes_validate")
    version = kubernetes_validate.latest_version()
    checked = []
    for document in _manifests():
        if document["kind"] == "TFJob":
            for role, replicas in document["spec"]["tfReplicaSpecs"].items():
                template = replicas["template"]
                pod = {"apiVersion": "v1", "kind": "Pod",
                       "metadata": {"name": f"tfjob-{role.lower()}",
                                    **template.get("metadata", {})},
                       "spec": template["spec"]}
                kubernetes_validate.validate(pod, version, strict=True)
                checked.append(f"TFJob {role} pod")
        else:
            kubernetes_validate.validate(document, version, strict=True)
            checked.append(document["kind"])
    assert {"ConfigMap", "PersistentVolumeClaim", "NetworkPolicy",
            "TFJob Worker pod"} <= set(checked), checked


# A timed collective leaves a sleeping thread behind: with collective_timeout = 120 a
# worker started about 175 threads a second (7,900 after 45 s; issue 14). Shipped configs
# must be safe for long runs, so none of them times its collectives.
TIMED_COLLECTIVES = ("collective_timeout", "timeout_seconds")


def _timed_collectives(path):
    """The timed-collective keys a config file sets: in its text with comments removed
    (a TOML key, a ``--set`` in a command, a ConfigMap's copy), and in the config it
    loads to when it is TOML."""
    code = "\n".join(line.split("#", 1)[0] for line in path.read_text().splitlines())
    found = {key for key in TIMED_COLLECTIVES if key in code}
    if path.suffix == ".toml":
        options = load_config(path)["strategy"]["options"]
        found |= {key for key in TIMED_COLLECTIVES if options.get(key) is not None}
    return found


@pytest.mark.unit
def test_no_shipped_config_times_its_collectives(tmp_path):
    shipped = sorted(p for p in (ROOT / "configs").rglob("*") if p.is_file())
    assert {"multi_worker.toml", "tfjob.yaml", "multi_worker.sbatch"} <= \
        {p.name for p in shipped}
    for path in shipped:
        assert not _timed_collectives(path), f"{path.relative_to(ROOT)} sets " \
            f"{sorted(_timed_collectives(path))}: a long run's threads grow without bound"
    # The check finds the key where a config would set it (not in a comment).
    bad = tmp_path / "bad.toml"
    bad.write_text('# collective_timeout in a comment is fine\n[strategy]\n'
                   'name = "multi_worker"\noptions = { collective_timeout = 120 }\n')
    assert _timed_collectives(bad) == {"collective_timeout"}
    command = tmp_path / "job.yaml"
    command.write_text('command: ["tfdist", "train", "c.toml", "--set", '
                       '"strategy.options.collective_timeout=120"]  # no\n')
    assert _timed_collectives(command) == {"collective_timeout"}
