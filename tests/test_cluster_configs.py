"""cluster/: the launcher YAMLs pass Ray's own validation, the KubeRay manifests have what KubeRay
needs, and every config keeps token authentication on and the dashboard private. Offline: no
cloud or Kubernetes API is contacted."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import jsonschema
import pytest
import ray
import yaml
from ray.autoscaler._private.util import prepare_config, validate_config

from rayfed.cli import build_parser
from rayfed.config import load_config

REPO = Path(__file__).resolve().parents[1]
CLUSTER = REPO / "cluster"
LAUNCHER_CONFIGS = ["aws.yaml", "gcp.yaml"]
RAY_IMAGE_TAG = re.compile(r"^rayproject/ray:(?P<version>[\d.]+)-py311-(?P<kind>cpu|gpu)$")


def _launcher(name: str) -> dict:
    return yaml.safe_load((CLUSTER / name).read_text())


def _manifests(name: str) -> dict[str, dict]:
    docs = yaml.safe_load_all((CLUSTER / "kuberay" / name).read_text())
    return {doc["kind"]: doc for doc in docs if doc}


def _env(container: dict) -> dict[str, dict]:
    return {item["name"]: item for item in container.get("env", [])}


# The cluster launcher ---------------------------------------------------------------------
@pytest.mark.parametrize("name", LAUNCHER_CONFIGS)
def test_launcher_config_passes_ray_validation(name):
    prepared = prepare_config(_launcher(name))  # merges the provider's defaults, as `ray up` does
    validate_config(prepared)
    assert prepared["head_node_type"] in prepared["available_node_types"]


def test_ray_validation_would_catch_a_broken_launcher_config():
    broken = _launcher("aws.yaml")
    broken["available_node_types"]["gpu_a10g"]["min_workers"] = broken["max_workers"] + 1
    with pytest.raises(ValueError, match="max_workers"):
        validate_config(prepare_config(broken))
    typo = _launcher("aws.yaml")
    typo["available_node_types"]["gpu_a10g"]["max_worker"] = 2
    with pytest.raises(jsonschema.ValidationError, match="max_worker"):
        validate_config(prepare_config(typo))


@pytest.mark.parametrize("name", LAUNCHER_CONFIGS)
def test_launcher_config_has_a_cpu_head_and_autoscaled_gpu_workers(name):
    config = _launcher(name)
    node_types = config["available_node_types"]
    head = node_types[config["head_node_type"]]
    assert head["resources"].get("GPU", 0) == 0 and head["resources"]["CPU"] > 0
    workers = {key: value for key, value in node_types.items() if key != config["head_node_type"]}
    assert workers
    for key, worker in workers.items():
        assert worker["resources"]["GPU"] >= 1, key
        assert 0 <= worker["min_workers"] <= worker["max_workers"], key
    assert sum(w["min_workers"] for w in workers.values()) <= config["max_workers"]
    assert max(w["max_workers"] for w in workers.values()) <= config["max_workers"]

    docker = config["docker"]
    head_image, worker_image = RAY_IMAGE_TAG.match(docker["head_image"]), RAY_IMAGE_TAG.match(docker["worker_image"])
    assert head_image and worker_image, "images must pin the Ray version and Python 3.11"
    assert head_image["version"] == worker_image["version"] == ray.__version__
    assert worker_image["kind"] == "gpu"


@pytest.mark.parametrize("name", LAUNCHER_CONFIGS)
def test_launcher_config_keeps_token_auth_on_and_the_dashboard_private(name):
    config = _launcher(name)
    text = (CLUSTER / name).read_text()
    run_options = " ".join(config["docker"]["run_options"])
    assert "--env RAY_AUTH_MODE=token" in run_options
    token_path = re.search(r"--env RAY_AUTH_TOKEN_PATH=(\S+)", run_options)
    assert token_path, "the token must come from a file, not from the YAML"
    assert str(Path(token_path[1]).parent) in config["file_mounts"]
    assert "RAY_AUTH_MODE=disabled" not in text and "RAY_AUTH_TOKEN=" not in text

    head_start = " ".join(config["head_start_ray_commands"])
    assert "--dashboard-host=127.0.0.1" in head_start
    commands = [*config["head_start_ray_commands"], *config["worker_start_ray_commands"]]
    assert not any("0.0.0.0" in command for command in commands)


@pytest.mark.parametrize("name", LAUNCHER_CONFIGS)
def test_launcher_config_installs_rayfed_from_the_built_wheel(name):
    config = _launcher(name)
    installs = [c for c in config["setup_commands"] if "pip install" in c and "rayfed" in c]
    assert installs, "setup_commands must install rayfed"
    wheel_dir = next(remote for remote, local in config["file_mounts"].items() if local.rstrip("/") == "./dist")
    for command in installs:
        # PyPI's `rayfed` is another project: only a wheel path or a git URL is acceptable.
        assert f"{wheel_dir}/rayfed-" in command and command.rstrip().endswith(".whl"), command


def test_dockerfile_builds_on_the_installed_ray_release():
    base = re.search(r"^ARG RAY_IMAGE=(\S+)$", (CLUSTER / "Dockerfile").read_text(), re.M)
    tag = RAY_IMAGE_TAG.match(base[1]) if base else None
    assert tag and tag["version"] == ray.__version__


def test_gcp_gpu_nodes_terminate_on_host_maintenance():
    config = _launcher("gcp.yaml")
    for key, node_type in config["available_node_types"].items():
        if node_type["resources"].get("GPU"):
            scheduling = node_type["node_config"]["scheduling"]
            assert isinstance(scheduling, dict), f"{key}: the Compute API takes scheduling as an object"
            assert scheduling["onHostMaintenance"] == "TERMINATE"


# KubeRay ----------------------------------------------------------------------------------
def _cluster_specs() -> dict[str, dict]:
    return {
        "RayCluster": _manifests("raycluster.yaml")["RayCluster"]["spec"],
        "RayJob": _manifests("rayjob.yaml")["RayJob"]["spec"]["rayClusterSpec"],
    }


@pytest.mark.parametrize("kind", ["RayCluster", "RayJob"])
def test_kuberay_manifest_has_the_required_fields(kind):
    manifest = _manifests("raycluster.yaml" if kind == "RayCluster" else "rayjob.yaml")[kind]
    assert manifest["apiVersion"] == "ray.io/v1" and manifest["metadata"]["name"]
    spec = _cluster_specs()[kind]
    assert spec["rayVersion"] == ray.__version__
    assert spec["enableInTreeAutoscaling"] is True

    head = spec["headGroupSpec"]
    assert head["serviceType"] == "ClusterIP", "the dashboard must not get a public Service"
    head_container = head["template"]["spec"]["containers"][0]
    assert head_container["image"] and head_container["resources"]["limits"]["cpu"]
    assert "nvidia.com/gpu" not in head_container["resources"]["limits"]

    assert spec["workerGroupSpecs"]
    for group in spec["workerGroupSpecs"]:
        assert 0 <= group["minReplicas"] <= group["replicas"] <= group["maxReplicas"], group["groupName"]
        assert group["maxReplicas"] > 0
        container = group["template"]["spec"]["containers"][0]
        assert container["image"]
        resources = container["resources"]
        assert int(resources["limits"]["nvidia.com/gpu"]) >= 1
        assert resources["requests"]["nvidia.com/gpu"] == resources["limits"]["nvidia.com/gpu"]


def _ray_containers() -> list[tuple[str, dict]]:
    containers = []
    for kind, spec in _cluster_specs().items():
        containers.append((f"{kind} autoscaler", spec["autoscalerOptions"]))
        containers += [(f"{kind} head", c) for c in spec["headGroupSpec"]["template"]["spec"]["containers"]]
        for group in spec["workerGroupSpecs"]:
            containers += [(f"{kind} {group['groupName']}", c) for c in group["template"]["spec"]["containers"]]
    submitter = _manifests("rayjob.yaml")["RayJob"]["spec"]["submitterPodTemplate"]["spec"]["containers"]
    return containers + [("RayJob submitter", c) for c in submitter]


def test_kuberay_keeps_token_auth_on_with_the_token_from_a_secret():
    secrets = set()
    for where, container in _ray_containers():
        env = _env(container)
        assert env.get("RAY_AUTH_MODE", {}).get("value") == "token", where
        token = env.get("RAY_AUTH_TOKEN", {})
        assert "value" not in token, f"{where}: a literal token in a manifest"
        secret = token.get("valueFrom", {}).get("secretKeyRef")
        assert secret, f"{where}: RAY_AUTH_TOKEN must come from a Secret"
        secrets.add((secret["name"], secret["key"]))
    assert len(secrets) == 1, f"one cluster token, not {secrets}"


def test_rayjob_runs_a_repository_config_and_keeps_results_on_a_volume():
    manifests = _manifests("rayjob.yaml")
    job = manifests["RayJob"]["spec"]
    argv = shlex.split(job["entrypoint"])
    assert argv[0] == "rayfed"
    args = build_parser().parse_args(argv[1:])
    assert args.command == "run" and args.out

    head = job["rayClusterSpec"]["headGroupSpec"]["template"]["spec"]
    mounts = {m["name"]: m["mountPath"] for m in head["containers"][0]["volumeMounts"]}
    volumes = {v["name"]: v for v in head["volumes"]}
    configs_mount = next(name for name, v in volumes.items() if "configMap" in v)
    config_path = Path(args.config)
    assert config_path.parent == Path(mounts[configs_mount])
    # The config mounted from the repository's configs/ must load with the entrypoint's overrides.
    load_config(REPO / "configs" / config_path.name, args.overrides)

    runs_volume = next(name for name, v in volumes.items() if "persistentVolumeClaim" in v)
    assert Path(mounts[runs_volume]) in Path(args.out).parents
    claim = volumes[runs_volume]["persistentVolumeClaim"]["claimName"]
    assert manifests["PersistentVolumeClaim"]["metadata"]["name"] == claim
    assert job["shutdownAfterJobFinishes"] is True


def test_readme_creates_the_secret_and_configmap_the_manifests_use():
    readme = (CLUSTER / "README.md").read_text()
    for name in ("raycluster.yaml", "rayjob.yaml"):
        manifest = (CLUSTER / "kuberay" / name).read_text()
        for kind, referenced in re.findall(r"(secretKeyRef|configMap): \{name: ([\w-]+)", manifest):
            command = "create secret generic" if kind == "secretKeyRef" else "create configmap"
            assert f"kubectl {command} {referenced}" in readme, (name, referenced)
