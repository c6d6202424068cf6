"""Adapter affinity: a request for a LoRA adapter loaded on demand (`lora_root`) goes to an engine replica that
already holds it, through Serve's model multiplexing, as Ray Serve LLM routes its LoRA requests. Each replica tells
Serve which such adapters it has served, in the engine's own bound (`max_loras`, least recently used out); the
ingress names the adapter on the handle call (`multiplexed_model_id`), and Serve's router prefers a replica that
holds it, so replicas do not all load every adapter in turn. Adapters listed in `lora_modules` are loaded on every
replica at start and route as the base model does. The engine still loads and drops adapters itself: this is a
routing hint, never a condition of service."""
from __future__ import annotations

from collections import OrderedDict
from collections.abc import Awaitable, Callable

from ray import serve
from ray.serve.handle import DeploymentHandle


def adapter_record(capacity: int) -> Callable[[str], Awaitable[str]]:
    """A replica's record of the adapters it holds, as Serve's multiplexing keeps it: call it with an adapter's name
    once a request on it is admitted. A function of its own per replica: Serve keeps its record on the function."""

    async def hold(name: str) -> str:
        return name  # nothing to load here: the engine loads the adapter for the request

    return serve.multiplexed(max_num_models_per_replica=capacity)(hold)


class AdapterRoutes:
    """Which adapters the ingress names to Serve's router. Serve's router keeps every name it was asked for and found
    on no replica, and any name that fits lora_root's pattern reaches here, so made-up names must not grow it without
    bound: a name a replica has admitted a request on is known (the KNOWN most recent); one not yet admitted is
    named while fewer than TRIED such names have been (a new adapter's first requests go where adapters are fewest);
    past that, an unknown name routes as the base model until a replica admits it."""

    KNOWN, TRIED = 1024, 256

    def __init__(self, loaded_everywhere: frozenset[str]):
        self.loaded_everywhere = loaded_everywhere  # lora_modules: on every replica from the start, no affinity
        self._known: OrderedDict[str, None] = OrderedDict()
        self._tried: set[str] = set()  # named to the router, never admitted (yet)

    def handle(self, handle: DeploymentHandle, lora_name: str | None) -> DeploymentHandle:
        """The handle for a call on `lora_name`: to a replica holding it, where it may be named."""
        if lora_name is None or lora_name in self.loaded_everywhere:
            return handle
        if lora_name in self._known:
            self._known.move_to_end(lora_name)
        elif lora_name in self._tried or len(self._tried) < self.TRIED:
            self._tried.add(lora_name)
        else:
            return handle
        return handle.options(multiplexed_model_id=lora_name)

    def admitted(self, lora_name: str | None) -> None:
        """A replica admitted a request on `lora_name`: it exists, and later calls name it."""
        if lora_name is None or lora_name in self.loaded_everywhere:
            return
        self._tried.discard(lora_name)
        self._known[lora_name] = None
        self._known.move_to_end(lora_name)
        if len(self._known) > self.KNOWN:
            self._known.popitem(last=False)
