"""Adapter affinity: a request for a LoRA adapter loaded on demand (`lora_root`) goes to an engine replica that
already holds it, through Serve's model multiplexing, as Ray Serve LLM routes its LoRA requests. Each replica tells
Serve which such adapters it has served, in the engine's own bound (`max_loras`, least recently used out); the
ingress names the adapter on the handle call (`multiplexed_model_id`), and Serve's router prefers a replica that
holds it, so replicas do not all load every adapter in turn. Adapters listed in `lora_modules` are loaded on every
replica at start and route as the base model does. The engine still loads and drops adapters itself: this is a
routing hint, never a condition of service."""
from __future__ import annotations

from collections.abc import Awaitable, Callable

from ray import serve
from ray.serve.handle import DeploymentHandle


def adapter_record(capacity: int) -> Callable[[str], Awaitable[str]]:
    """A replica's record of the adapters it holds, as Serve's multiplexing keeps it: call it with an adapter's name
    once a request on it is admitted. A function of its own per replica: Serve keeps its record on the function."""

    async def hold(name: str) -> str:
        return name  # nothing to load here: the engine loads the adapter for the request

    return serve.multiplexed(max_num_models_per_replica=capacity)(hold)


def routed(handle: DeploymentHandle, lora_name: str | None, everywhere: frozenset[str] | None) -> DeploymentHandle:
    """The handle for a call on `lora_name`: to a replica holding it where it is loaded on demand (not in
    `everywhere`); None: no affinity at all (the app's `adapter_affinity: false`)."""
    if lora_name is None or everywhere is None or lora_name in everywhere:
        return handle
    return handle.options(multiplexed_model_id=lora_name)
