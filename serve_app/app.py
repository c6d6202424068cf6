"""The application builder: `serve run serve_app.app:build_app` (args from a config) or `serve_app.app:app`."""
from __future__ import annotations

from typing import Any

from ray import serve
from ray.serve import Application
from ray.serve.config import BackpressureConfig, RequestRouterConfig

from serve_app.colocated import ColocatedDeployment
from serve_app.config import AppArgs
from serve_app.ingress import IngressDeployment
from serve_app.prefix_router import PrefixAffinityRouter
from serve_app.replica import EngineReplica

INGRESS_TARGET_ONGOING = 256


def build_app(args: dict[str, Any] | AppArgs | None = None) -> Application:
    args = args if isinstance(args, AppArgs) else AppArgs(**(args or {}))
    if args.topology == "colocated":
        return serve.deployment(ColocatedDeployment).options(name="EngineIngress", **replica_options(args)).bind(args)
    replicas = [serve.deployment(EngineReplica).options(name=replica_deployment_name(model, first=not k),
                                                        **replica_options(model), **request_router(model)).bind(model)
                for k, model in enumerate(args.served_models)]
    ingress = serve.deployment(IngressDeployment).options(
        name="Ingress",
        ray_actor_options={"num_cpus": 0, "resources": args.ingress_resources},  # 0 CPUs: the engine replica must fit beside it
        max_ongoing_requests=4 * INGRESS_TARGET_ONGOING,
        max_queued_requests=args.max_queued_requests,
        backpressure_config=backpressure(args),
        autoscaling_config={"min_replicas": args.ingress_min_replicas, "max_replicas": args.ingress_max_replicas,
                            "target_ongoing_requests": INGRESS_TARGET_ONGOING},
        graceful_shutdown_timeout_s=args.drain_timeout_s,
    )
    return ingress.bind(replicas[0], args, replicas[1:])


def replica_deployment_name(model: AppArgs, first: bool) -> str:
    """The first model's engine replicas are `EngineReplica` (dashboards and alerts name it); another model's are
    named for it, as Ray Serve LLM names its servers (`LLMServer:<model id>`, `/` as `--`)."""
    return "EngineReplica" if first else "EngineReplica:" + model.model_name.replace("/", "--").replace("#", "_")


def replica_options(args: AppArgs) -> dict[str, Any]:
    """An engine replica's deployment options, whether it serves HTTP itself (colocated) or not."""
    return dict(
        ray_actor_options={"num_cpus": args.num_cpus, "num_gpus": args.num_gpus,
                           **({"accelerator_type": args.accelerator_type} if args.accelerator_type else {})},
        max_ongoing_requests=args.replica_max_ongoing_requests,
        max_queued_requests=args.max_queued_requests,
        backpressure_config=backpressure(args),
        autoscaling_config={
            "min_replicas": args.min_replicas,
            "max_replicas": args.max_replicas,
            "target_ongoing_requests": args.target_ongoing_requests or args.engine_config.max_num_seqs,
            "upscale_delay_s": args.upscale_delay_s,
            "downscale_delay_s": args.downscale_delay_s,
            "look_back_period_s": args.look_back_period_s,
            **engine_signal_policy(args),
        },
        graceful_shutdown_timeout_s=args.drain_timeout_s,
        health_check_period_s=5,
    )


def backpressure(args: AppArgs) -> BackpressureConfig:
    return BackpressureConfig(status_code=429, retry_after_s=args.retry_after_s)


def request_router(args: AppArgs) -> dict[str, Any]:
    """The engine replicas' router option for `request_router: prefix_affinity`; nothing (Serve's default) otherwise."""
    if args.request_router != "prefix_affinity":
        return {}
    return {"request_router_config": RequestRouterConfig(request_router_class=PrefixAffinityRouter,
                                                         request_router_kwargs=args.prefix_affinity.model_dump())}


def engine_signal_policy(args: AppArgs) -> dict[str, Any]:
    """Serve's `policy` for `autoscaling_policy: engine`; nothing (Serve's default) otherwise."""
    if args.autoscaling_policy != "engine":
        return {}
    return {"policy": {"policy_function": "serve_app.autoscaling:EngineSignalPolicy",
                       "policy_kwargs": args.engine_signal_targets.model_dump()}}


app = build_app()
