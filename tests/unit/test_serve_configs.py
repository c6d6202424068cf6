"""The shipped Serve configs load through Ray Serve's own schema, and their args through AppArgs."""
from pathlib import Path

import pytest
import yaml
from ray.serve.schema import ServeDeploySchema

from serve_app.app import build_app
from serve_app.config import AppArgs
from serve_app.security import exposure_problem

ROOT = Path(__file__).resolve().parents[2]
CONFIGS = sorted((ROOT / "serve_app").glob("config*.yaml"))
assert len(CONFIGS) >= 2, f"the shipped Serve configs were not found under {ROOT}"


@pytest.mark.parametrize("path", CONFIGS, ids=[p.name for p in CONFIGS])
def test_config_passes_serve_schema_and_app_args(path):
    raw = yaml.safe_load(path.read_text())
    schema = ServeDeploySchema.model_validate(raw) if hasattr(ServeDeploySchema, "model_validate") else ServeDeploySchema.parse_obj(raw)
    (application,) = schema.applications
    assert application.import_path == "serve_app.app:build_app"
    args = AppArgs(**application.args)
    build_app(args)  # the deployment options it implies are valid


def test_local_config_binds_loopback_and_gpu_config_asks_for_gpus():
    local = yaml.safe_load((ROOT / "serve_app/config.yaml").read_text())
    gpu = yaml.safe_load((ROOT / "serve_app/config.gpu.yaml").read_text())
    assert local["http_options"]["host"] == "127.0.0.1" and local["http_options"]["port"] == 8000
    gpu_args = AppArgs(**gpu["applications"][0]["args"])
    assert gpu_args.num_gpus == 1 and gpu_args.engine_config.device == "cuda" and gpu_args.engine_config.max_tokens_limit == 2048


def test_replica_concurrency_is_sized_to_the_engine_not_serve_defaults():
    args = AppArgs(engine_config={"max_num_seqs": 64, "max_waiting": 100})
    assert args.replica_max_ongoing_requests > 64 + 100
    assert AppArgs().model_name == "SmolLM2-135M-Instruct"


@pytest.mark.parametrize("path", CONFIGS, ids=[p.name for p in CONFIGS])
def test_a_shipped_config_exposed_beyond_loopback_refuses_to_start_without_a_key(path, monkeypatch):
    monkeypatch.delenv("LLM_SERVE_API_KEY", raising=False)
    raw = yaml.safe_load(path.read_text())
    args = AppArgs(**raw["applications"][0]["args"])
    host = raw["http_options"]["host"]
    problem = exposure_problem(host, args.api_key, args.allow_unauthenticated)
    assert (problem is None) == (host == "127.0.0.1"), (host, problem)
    monkeypatch.setenv("LLM_SERVE_API_KEY", "from-the-environment")
    args = AppArgs(**raw["applications"][0]["args"])
    assert exposure_problem(host, args.api_key, args.allow_unauthenticated) is None


def test_the_drain_outlasts_any_accepted_request_unless_set():
    assert AppArgs().drain_timeout_s > AppArgs().request_timeout_s
    assert AppArgs(request_timeout_s=1200).drain_timeout_s > 1200
    assert AppArgs(graceful_shutdown_timeout_s=5).drain_timeout_s == 5


def test_serving_defaults_bound_the_queue_and_max_tokens_under_any_engine_settings():
    assert AppArgs().engine_config.max_waiting == 256 and AppArgs().engine_config.max_tokens_limit == 4096
    args = AppArgs(engine_config={"model": "x", "max_num_seqs": 8})
    assert args.engine_config.max_waiting == 256 and args.engine_config.max_num_seqs == 8 and args.model_name == "x"
    assert AppArgs(engine_config={"max_waiting": 5}).engine_config.max_waiting == 5
    with pytest.raises(ValueError):
        AppArgs(max_num_seqs=8)  # engine knobs live under `engine`, never copied onto AppArgs


def test_ray_env_cli_gives_the_haproxy_mode_unless_told_python_proxy():
    """`make serve` runs Serve's CLI with `env $(python -m serve_app.ray_env)`."""
    import subprocess
    import sys

    from serve_app.ray_env import RAY_ENV, THROUGHPUT_ENV

    def words(*args):
        out = subprocess.run([sys.executable, "-m", "serve_app.ray_env", *args], capture_output=True, text=True, check=True)
        return dict(word.split("=", 1) for word in out.stdout.split())

    assert words("--python-proxy") == RAY_ENV and not THROUGHPUT_ENV.keys() & RAY_ENV.keys()
    throughput = words()
    socket = Path(throughput.pop("RAY_SERVE_HAPROXY_SOCKET_PATH"))
    fence = Path(throughput.pop("RAY_SERVE_HAPROXY_BINARY_PATH"))
    assert throughput == {**RAY_ENV, **THROUGHPUT_ENV}
    assert fence == Path(sys.executable).parent / "llm-serve-haproxy", "Ray runs serve_app/haproxy_fence.py as haproxy"
    assert socket.parent.stat().st_mode & 0o777 == 0o700, "HAProxy's admin socket (mode 666) sits where only we reach"
    assert THROUGHPUT_ENV == {"RAY_SERVE_THROUGHPUT_OPTIMIZED": "1", "RAY_SERVE_ENABLE_HA_PROXY": "1"}


def test_ray_env_turns_on_token_auth_and_writes_a_token_only_its_owner_reads(tmp_path, monkeypatch):
    from serve_app.ray_env import RAY_ENV, ensure_auth_token

    assert RAY_ENV["RAY_AUTH_MODE"] == "token"
    monkeypatch.setenv("HOME", str(tmp_path))
    for name in ("RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH"):
        monkeypatch.delenv(name, raising=False)
    ensure_auth_token()
    token = tmp_path / ".ray" / "auth_token"
    assert token.stat().st_mode & 0o777 == 0o600 and len(token.read_text()) == 64
    first = token.read_text()
    ensure_auth_token()
    assert token.read_text() == first, "an existing token is kept: the running cluster's clients hold it"
    token.unlink()
    monkeypatch.setenv("RAY_AUTH_TOKEN", "from-the-operator")
    ensure_auth_token()
    assert not token.exists(), "a token the operator passes is the one Ray uses; no file is made"


def test_served_model_names_are_one_or_more_distinct_names():
    assert AppArgs(served_model_name="a").model_names == ["a"]
    assert AppArgs(served_model_name=["a", "b"]).model_name == "a"
    assert AppArgs().model_names == ["SmolLM2-135M-Instruct"]
    for bad in ([], ["a", "a"], ["a", ""]):
        with pytest.raises(ValueError, match="served_model_name: one or more distinct, non-empty names"):
            AppArgs(served_model_name=bad)


def test_each_served_model_has_its_own_fields_and_the_apps_server_wide_ones():
    args = AppArgs(served_model_name="small", num_cpus=2, request_timeout_s=99, api_key="k",
                   models=[{"engine_config": {"model": "org/big-model", "max_num_seqs": 8}, "num_gpus": 1,
                            "reasoning_parser": "qwen3"}])
    first, second = args.served_models
    assert (first.model_name, first.num_cpus, first.num_gpus, first.reasoning_parser) == ("small", 2, 0, None)
    assert (second.model_name, second.num_cpus, second.num_gpus, second.reasoning_parser) == ("big-model", 1, 1, "qwen3")
    assert second.engine_config.max_num_seqs == 8 and second.engine_config.max_waiting == 256  # serving defaults too
    assert (second.request_timeout_s, second.api_key) == (99, "k") and first.models == second.models == []
    build_app(args)


def test_several_models_need_names_of_their_own_and_the_split_topology():
    with pytest.raises(ValueError, match=r"\['SmolLM2-135M-Instruct'\] name more than one"):
        AppArgs(models=[{}])
    with pytest.raises(ValueError, match=r"\['shared'\] name more than one"):  # an adapter's name is a model's too
        AppArgs(served_model_name="shared", models=[{"served_model_name": "other", "engine_config": {
            "lora_modules": [{"name": "shared", "path": "/adapters/shared"}]}}])
    with pytest.raises(ValueError, match="topology: split"):
        AppArgs(topology="colocated", models=[{"served_model_name": "other"}])
    with pytest.raises(ValueError, match="extra"):
        AppArgs(models=[{"served_model_name": "other", "api_key": "k"}])  # server-wide fields are the app's alone


def test_another_models_replicas_are_named_for_it_as_ray_serve_llm_names_its_servers():
    from serve_app.app import replica_deployment_name

    first, second = AppArgs(models=[{"served_model_name": "Qwen/Qwen2.5-1.5B"}]).served_models
    assert replica_deployment_name(first, first=True) == "EngineReplica"
    assert replica_deployment_name(second, first=False) == "EngineReplica:Qwen--Qwen2.5-1.5B"


def test_a_models_replicas_can_ask_for_a_kind_of_gpu_as_ray_serve_llm_places_them():
    from serve_app.app import replica_options

    args = AppArgs(num_gpus=1, accelerator_type="L4", models=[{"served_model_name": "big", "num_gpus": 1,
                                                               "accelerator_type": "H200"}])
    first, second = (replica_options(model)["ray_actor_options"] for model in args.served_models)
    assert first == {"num_cpus": 1, "num_gpus": 1, "accelerator_type": "L4"}
    assert second["accelerator_type"] == "H200" and "accelerator_type" not in replica_options(AppArgs())["ray_actor_options"]
    build_app(args)
    with pytest.raises(ValueError, match="not an accelerator type Ray knows"):
        AppArgs(num_gpus=1, accelerator_type="H100-SXM")
    with pytest.raises(ValueError, match="num_gpus: 0"):
        AppArgs(accelerator_type="H100")
