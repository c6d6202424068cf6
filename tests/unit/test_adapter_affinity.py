"""Which handle calls name their adapter to Serve's router: only those on an adapter loaded on demand, and none where
the app turned affinity off. The routing itself is Serve's, checked live in tests/serve/test_prefix_routing.py."""
from serve_app.adapter_affinity import routed


class Handle:
    """A stand-in for a DeploymentHandle that says which options it was given (pure logic, no Serve)."""

    def __init__(self, **options):
        self.given = options

    def options(self, **options):
        return Handle(**self.given, **options)


def test_only_adapters_loaded_on_demand_are_named_to_the_router():
    handle, loaded_everywhere = Handle(), frozenset({"listed"})
    assert routed(handle, "on-demand", loaded_everywhere).given == {"multiplexed_model_id": "on-demand"}
    assert routed(handle, "listed", loaded_everywhere) is handle  # lora_modules: on every replica, no affinity
    assert routed(handle, None, loaded_everywhere) is handle  # the base model
    assert routed(handle, "on-demand", None) is handle  # adapter_affinity: false
