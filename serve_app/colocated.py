"""`topology: colocated`: the ingress and one engine replica in one Serve replica. Serve's proxy then reaches the
engine's front end in one Ray hop, where the split topology pays a Ray message per streamed chunk twice, once into
the ingress and once out of it (issue 45's serving cost; the figures are in BENCHMARKS.md). It scales as the
engine replicas do: one per GPU."""
from __future__ import annotations

from ray import serve

from serve_app.config import AppArgs
from serve_app.ingress import Ingress, refuse_exposure
from serve_app.replica import EngineReplica
from serve_app.replica_client import LocalReplica
from serve_app.protocol import ReplicaStats


class ColocatedIngress(Ingress):
    def __init__(self, args: AppArgs):
        refuse_exposure(args)  # before the model loads, so a refused start is quick
        self.engine_replica = EngineReplica(args)
        super().__init__(LocalReplica(self.engine_replica), args)

    def record_autoscaling_stats(self) -> dict[str, float]:
        return self.engine_replica.record_autoscaling_stats()

    async def check_health(self) -> None:
        await self.engine_replica.check_health()

    def stats(self) -> ReplicaStats:
        """What the split topology's EngineReplica.stats() answers, for operators' and tests' handles."""
        return self.engine_replica.stats()

    def __del__(self):
        replica = getattr(self, "engine_replica", None)  # absent when the exposure check refused the start
        if replica is not None:
            replica.close_engine()


ColocatedDeployment = serve.ingress()(ColocatedIngress)
