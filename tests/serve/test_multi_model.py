"""Several models behind one ingress (Ray Serve LLM's `llm_configs`): each on engine replicas of its own, a request
routed by its `model`, `/v1/models` listing every one from its own replica, a request with no `model` refused once
there is more than one, the replicas' metrics labelled by model. Both models are the embedded one, told apart by their
names and by the second's shorter context, which only its own engine enforces."""
import time

import httpx
import pytest

from tests.serve.conftest import wait_idle, whole_app

pytestmark = pytest.mark.slow
FIRST, SECOND = "smol", "smol-short"
SHORT_CONTEXT = 256


@pytest.fixture(scope="module")
def multi_app(serve_app):
    engine = {**serve_app["args"]["engine_config"], "num_kv_blocks": 128, "max_num_seqs": 8}
    second = {"served_model_name": SECOND, "num_cpus": 0.5,
              "engine_config": {**engine, "max_model_len": SHORT_CONTEXT, "num_kv_blocks": 64}}
    # half a CPU each: the session's Ray cluster has two, one held by the session's own replica
    with whole_app(serve_app, "multi", served_model_name=FIRST, num_cpus=0.5, engine_config=engine,
                   models=[second]) as base:
        yield base


@pytest.fixture(autouse=True)
def both_replicas_free_after_test(multi_app):
    from ray import serve

    yield
    for deployment in ("EngineReplica", f"EngineReplica:{SECOND}"):
        wait_idle(serve.get_deployment_handle(deployment, app_name="multi"))


def chat(base: str, auth: dict, content: str, **fields) -> httpx.Response:
    body = {"messages": [{"role": "user", "content": content}], "max_tokens": 8, "temperature": 0} | fields
    return httpx.post(f"{base}/v1/chat/completions", json=body, headers=auth, timeout=120)


def test_each_model_is_served_by_its_own_replicas(multi_app, auth):
    from ray import serve

    deployments = serve.status().applications["multi"].deployments
    assert set(deployments) == {"Ingress", "EngineReplica", f"EngineReplica:{SECOND}"}, deployments
    listed = httpx.get(f"{multi_app}/v1/models", headers=auth, timeout=30).json()["data"]
    assert [card["id"] for card in listed] == [FIRST, SECOND]
    assert listed[1]["max_model_len"] == SHORT_CONTEXT < listed[0]["max_model_len"]  # each card from its own engine
    assert httpx.get(f"{multi_app}/v1/models/{SECOND}", headers=auth, timeout=30).json() == listed[1]
    health = httpx.get(f"{multi_app}/health", timeout=30)
    assert health.status_code == 200 and health.json()["status"] == "ok"
    assert set(health.json()["models"]) == {FIRST, SECOND}, health.json()  # each model's running and waiting


def test_a_request_reaches_the_model_it_names(multi_app, auth):
    """The same weights answer the same greedy text under either name, each echoing its own; a prompt past the second
    model's context is refused by its engine alone."""
    answers = {name: chat(multi_app, auth, "Name three colours.", model=name) for name in (FIRST, SECOND)}
    for name, response in answers.items():
        assert response.status_code == 200, response.text
        assert response.json()["model"] == name
    assert answers[FIRST].json()["choices"][0]["message"] == answers[SECOND].json()["choices"][0]["message"]
    long_prompt = "one two three four five six seven eight " * 40  # ~320 tokens: past 256, well inside the first's
    assert chat(multi_app, auth, long_prompt, model=FIRST, max_tokens=2).status_code == 200
    refused = chat(multi_app, auth, long_prompt, model=SECOND, max_tokens=2)
    assert refused.status_code == 400 and str(SHORT_CONTEXT) in refused.json()["error"]["message"], refused.text


def test_with_several_models_a_request_must_name_a_served_one(multi_app, auth):
    missing = chat(multi_app, auth, "Hi.")
    assert missing.status_code == 400 and missing.json()["error"]["param"] == "model", missing.text
    assert f"'{FIRST}' or '{SECOND}'" in missing.json()["error"]["message"]
    unknown = chat(multi_app, auth, "Hi.", model="gpt-4o")
    assert unknown.status_code == 404 and unknown.json()["error"]["code"] == "model_not_found", unknown.text
    assert f"this server serves '{FIRST}' or '{SECOND}'" in unknown.json()["error"]["message"]
    # Anthropic's route answers in its own envelope; a model is required there in any case
    anthropic = httpx.post(f"{multi_app}/v1/messages", json={"model": "claude-x", "max_tokens": 4, "messages": [
        {"role": "user", "content": "Hi."}]}, headers=auth, timeout=30)
    assert anthropic.status_code == 404 and anthropic.json()["error"]["type"] == "not_found_error", anthropic.text
    tokenized = httpx.post(f"{multi_app}/tokenize", json={"model": SECOND, "prompt": "Hi there"}, headers=auth, timeout=30)
    assert tokenized.status_code == 200 and tokenized.json()["max_model_len"] == SHORT_CONTEXT, tokenized.text


def test_each_models_metrics_carry_its_name(multi_app, serve_app, auth):
    assert chat(multi_app, auth, "Hello!", model=SECOND).status_code == 200
    deadline = time.monotonic() + 30  # Ray exports every second here; its agent may take a few
    while True:
        text = httpx.get(f"http://127.0.0.1:{serve_app['metrics_port']}/metrics", timeout=10).text
        labelled = [line for line in text.splitlines() if line.startswith("ray_engine_generation_tokens_total")
                    and f'model_name="{SECOND}"' in line]
        if labelled:
            break
        assert time.monotonic() < deadline, "no generation-token series labelled with the second model's name"
        time.sleep(1)
