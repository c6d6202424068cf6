"""Which handle calls name their adapter to Serve's router: adapters loaded on demand, never more names that no
replica has admitted than a bound, so made-up names cannot grow the router's state. The routing itself is Serve's,
checked live in tests/serve/test_prefix_routing.py."""
from serve_app.adapter_affinity import AdapterRoutes


class Handle:
    """A stand-in for a DeploymentHandle that says which options it was given (pure logic, no Serve)."""

    def __init__(self, **options):
        self.given = options

    def options(self, **options):
        return Handle(**self.given, **options)


def named(routes: AdapterRoutes, name: str | None) -> bool:
    handle = Handle()
    routed = routes.handle(handle, name)
    return routed is not handle and routed.given == {"multiplexed_model_id": name}


def test_adapters_loaded_on_demand_are_named_and_others_are_not():
    routes = AdapterRoutes(frozenset({"listed"}))
    assert named(routes, "on-demand")  # a new adapter's first request: where adapters are fewest
    assert not named(routes, "listed")  # lora_modules: on every replica, no affinity
    assert not named(routes, None)  # the base model


def test_names_no_replica_admitted_are_bounded_and_admitted_ones_always_named(monkeypatch):
    monkeypatch.setattr(AdapterRoutes, "TRIED", 2)
    monkeypatch.setattr(AdapterRoutes, "KNOWN", 2)
    routes = AdapterRoutes(frozenset())
    assert named(routes, "made-up-1") and named(routes, "made-up-2")
    assert not named(routes, "made-up-3")  # two unadmitted names already went to the router
    assert named(routes, "made-up-1")  # one already there costs nothing more
    routes.admitted("real")  # admitted though routed unnamed: known from now on
    assert named(routes, "real")
    routes.admitted("made-up-1")  # admitted after all: a tried slot frees
    assert named(routes, "new")
    routes.admitted("b")  # known: real, made-up-1, b -> the least recent (real) goes
    assert not named(routes, "real") and named(routes, "b")
