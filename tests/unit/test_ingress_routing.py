"""Which model's front a request reaches, by its `model`: pure routing logic over the app's args (the replicas are
stand-ins that are never called; the served behaviour is tests/serve/test_multi_model.py's)."""
import pytest

from serve_app import ingress
from serve_app.config import AppArgs
from serve_app.errors import OpenAIError


@pytest.fixture(autouse=True)
def no_serve_process(monkeypatch):
    monkeypatch.setattr(ingress, "freeze_gc_heap", lambda: None)  # the pytest process's heap stays collectable
    monkeypatch.setattr(ingress, "refuse_exposure", lambda args: None)  # no Serve to ask (tests/serve/test_exposure.py)


@pytest.fixture
def two_models() -> ingress.Ingress:
    args = AppArgs(served_model_name=["small", "small-alias"], models=[{
        "served_model_name": "big", "engine_config": {"model": "x/big", "lora_root": "/adapters",
                                                      "lora_modules": [{"name": "pirate", "path": "/p"}]}}])
    return ingress.Ingress(object(), args, [object()])


def test_a_request_reaches_the_front_of_the_model_or_adapter_it_names(two_models):
    small, big = two_models.fronts
    assert two_models.front("small") is small and two_models.front("small-alias") is small
    assert two_models.front("big") is big and two_models.front("pirate") is big
    assert two_models.front("any-adapter-under-the-root") is big  # the only model with a lora_root
    assert big._model_name("pirate") == "pirate" and small._model_name("small-alias") == "small-alias"


def test_with_several_models_a_request_names_one_it_serves(two_models):
    with pytest.raises(OpenAIError) as missing:
        two_models.front(None)
    assert (missing.value.status, missing.value.param) == (400, "model")
    with pytest.raises(OpenAIError) as unknown:
        two_models.front("no/such model")  # not an adapter name either
    assert (unknown.value.status, unknown.value.code) == (404, "model_not_found")
    assert "'small' or 'small-alias' or 'big' and the LoRA adapters 'pirate'" in unknown.value.message


def test_with_one_model_a_request_may_leave_it_out():
    one = ingress.Ingress(object(), AppArgs())
    assert one.front(None) is one.fronts[0]
