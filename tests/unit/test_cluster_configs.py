"""Cluster configs: the launcher YAMLs pass Ray's own validator; the KubeRay manifest carries config.gpu.yaml exactly."""
import copy
from pathlib import Path

import jsonschema
import pytest
import yaml
from ray.autoscaler._private.util import prepare_config, validate_config
from ray.serve.schema import ServeDeploySchema

ROOT = Path(__file__).resolve().parents[2]
LAUNCHERS = ["cluster/aws-gpu.yaml", "cluster/gcp-gpu.yaml"]


def load(path: str) -> dict:
    return yaml.safe_load((ROOT / path).read_text())


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
    assert any("HF_HOME" in c for c in config["setup_commands"]) and any("HF_TOKEN" in c for c in config["setup_commands"])


def test_kuberay_serve_config_is_config_gpu_yaml_and_passes_serve_schema():
    manifest = load("cluster/kuberay-rayservice.yaml")
    serve_config = yaml.safe_load(manifest["spec"]["serveConfigV2"])
    assert serve_config == load("serve_app/config.gpu.yaml"), "cluster/kuberay-rayservice.yaml drifted from config.gpu.yaml"
    ServeDeploySchema.model_validate(serve_config)


def test_kuberay_groups_head_without_gpus_metrics_port_and_resources():
    spec = load("cluster/kuberay-rayservice.yaml")["spec"]["rayClusterConfig"]
    head = spec["headGroupSpec"]
    assert head["rayStartParams"]["num-gpus"] == "0" and head["rayStartParams"]["metrics-export-port"] == "8080"
    (gpu,) = spec["workerGroupSpecs"]
    container = gpu["template"]["spec"]["containers"][0]
    assert container["resources"]["limits"]["nvidia.com/gpu"] == "1"
    assert container["resources"]["requests"] == container["resources"]["limits"]
    assert {"containerPort": 8080, "name": "metrics"} in container["ports"]
    assert gpu["minReplicas"] <= gpu["replicas"] <= gpu["maxReplicas"]
