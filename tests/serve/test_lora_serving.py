"""LoRA adapters served as models (vLLM's `--lora-modules`): a request naming an adapter as its `model` gets that
adapter's output, PEFT's own in fp32, while requests for the base model beside it get the base model's; the listing
shows each adapter with the base as its parent; an unknown name is a 404 that lists what is served. The app is
colocated, as the shipped configs are (the session's app is split)."""
import json

import httpx
import pytest
import torch

from engine.config import DEFAULT_MODEL
from engine.models import resolve_model_path
from tests.fixtures.lora_adapters import make_adapter
from tests.serve.conftest import wait_idle, whole_app

pytestmark = pytest.mark.slow
ADAPTER = "terse-pirate"
ON_DEMAND = "pirate-on-demand"  # the same adapter under lora_root: loaded when first named
PROMPTS = ["The lighthouse keeper climbed the stairs and", "A short list of things to pack for a rainy hike:"]
NEW_TOKENS = 12


@pytest.fixture(scope="module")
def adapter_dir(tmp_path_factory):
    """A PEFT adapter of the embedded model with random weights."""
    return make_adapter(DEFAULT_MODEL, tmp_path_factory.mktemp("adapter") / ADAPTER, 7, b_std=0.02, r=8, lora_alpha=16,
                        target_modules=["q_proj", "v_proj", "down_proj"])


@pytest.fixture(scope="module")
def expected(adapter_dir) -> dict[str, list[str]]:
    """Greedy continuations of PROMPTS by transformers in fp32: the base model's, and with PEFT applying the adapter."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = resolve_model_path(DEFAULT_MODEL)
    tokenizer = AutoTokenizer.from_pretrained(path)
    base = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()

    def continuations(model) -> list[str]:
        texts = []
        for prompt in PROMPTS:
            ids = tokenizer(prompt, return_tensors="pt").input_ids
            with torch.inference_mode():
                out = model.generate(ids, max_new_tokens=NEW_TOKENS, do_sample=False, min_new_tokens=NEW_TOKENS)
            texts.append(tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True))
        return texts

    base_texts = continuations(base)
    adapted = continuations(PeftModel.from_pretrained(base, adapter_dir).eval())
    assert adapted != base_texts, "the adapter changes nothing: the test could not fail"
    return {DEFAULT_MODEL: base_texts, ADAPTER: adapted, ON_DEMAND: adapted}


@pytest.fixture(scope="module")
def lora_app(serve_app, adapter_dir, tmp_path_factory):
    import shutil

    root = tmp_path_factory.mktemp("lora-root")
    shutil.copytree(adapter_dir, root / ON_DEMAND)
    engine = {**serve_app["args"]["engine_config"], "num_kv_blocks": 256,
              "lora_modules": [{"name": ADAPTER, "path": adapter_dir}], "lora_root": str(root)}
    with whole_app(serve_app, "lora", topology="colocated", engine_config=engine) as base:
        yield base


@pytest.fixture(autouse=True)
def lora_replica_free_after_test(lora_app):
    """As conftest's check for the session's replica: this app's replica idle, every block free."""
    from ray import serve

    yield
    wait_idle(serve.get_deployment_handle("EngineIngress", app_name="lora"))


def test_each_request_gets_the_model_it_names_in_the_same_batches(lora_app, auth, expected):
    """Base and adapter requests sent together, so they share engine steps; each answer is its own model's, named in
    `model`."""
    import asyncio

    async def complete(client, model: str, prompt: str) -> dict:
        r = await client.post("/v1/completions", json={"model": model, "prompt": prompt, "max_tokens": NEW_TOKENS,
                                                       "temperature": 0, "ignore_eos": True})
        assert r.status_code == 200, r.text
        return r.json()

    async def all_at_once():
        async with httpx.AsyncClient(base_url=lora_app, headers=auth, timeout=120) as client:
            return await asyncio.gather(*[complete(client, model, prompt) for model in expected for prompt in PROMPTS])

    bodies = iter(asyncio.run(all_at_once()))
    for model, texts in expected.items():
        for text in texts:
            body = next(bodies)
            assert body["model"] == model
            assert body["choices"][0]["text"] == text, model


def test_a_streamed_chat_names_the_adapter_in_every_chunk(lora_app, auth):
    with httpx.Client(base_url=lora_app, headers=auth, timeout=120) as http:
        with http.stream("POST", "/v1/chat/completions", json={
                "model": ADAPTER, "messages": [{"role": "user", "content": "Say hello."}], "max_tokens": 6,
                "stream": True}) as r:
            assert r.status_code == 200
            chunks = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    assert chunks and {c["model"] for c in chunks} == {ADAPTER}


def test_models_lists_the_adapter_under_its_base_and_unknown_names_are_404(lora_app, auth):
    with httpx.Client(base_url=lora_app, headers=auth, timeout=30) as http:
        listed = http.get("/v1/models").json()["data"]
        assert [m["id"] for m in listed] == [DEFAULT_MODEL, ADAPTER, ON_DEMAND]  # lora_modules', then lora_root's
        assert "parent" not in listed[0] and {m["parent"] for m in listed[1:]} == {DEFAULT_MODEL}
        assert http.get(f"/v1/models/{ADAPTER}").json()["parent"] == DEFAULT_MODEL
        # not an adapter's name (the ingress lists what is served); a name with nothing under lora_root (the replica)
        for name, says in (("no such/name", f"'{ADAPTER}'"), ("other-adapter", "no such LoRA adapter")):
            r = http.post("/v1/completions", json={"model": name, "prompt": "hi", "max_tokens": 2})
            error = r.json()["error"]
            assert r.status_code == 404 and error["param"] == "model" and error["code"] == "model_not_found", name
            assert f"'{name}'" in error["message"] and says in error["message"], error
        tokens = http.post("/tokenize", json={"model": ADAPTER, "prompt": "hello there"})
        assert tokens.status_code == 200 and tokens.json()["count"] >= 2
