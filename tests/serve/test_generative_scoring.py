"""vLLM's generative scoring route against the real app under Ray Serve (fp32 engine, embedded model): each item's
score is the first label token's next-token probability after the query joined with the item, as transformers
computes it, over the labels or the whole vocabulary; what cannot be is a 400 naming the field."""
import math
import re

import httpx
import pytest
import torch

from serve_app.generative_scoring_api import GenerativeScoringRequest
from tests.engine.helpers import load_hf_model
from tests.serve.test_openai_fields import README

pytestmark = pytest.mark.slow
MODEL = "SmolLM2-135M-Instruct"
QUERY = "Question: is Paris the capital of France? Answer (yes or no):"


def post(serve_app, path: str, body: dict) -> httpx.Response:
    return httpx.post(serve_app["base_url"] + path, json=body, timeout=120,
                      headers={"Authorization": f"Bearer {serve_app['api_key']}"})


def tokens(serve_app, text: str) -> list[int]:
    return post(serve_app, "/tokenize", {"prompt": text}).json()["tokens"]  # the embedded model adds no BOS


@pytest.fixture(scope="module")
def hf_next_logprobs():
    model = load_hf_model(MODEL)

    def next_logprobs(ids: list[int]) -> torch.Tensor:
        with torch.no_grad():
            return torch.log_softmax(model(torch.tensor([ids])).logits[0, -1].float(), -1)

    return next_logprobs


def test_each_items_score_is_the_first_labels_probability_as_transformers_computes_it(serve_app, hf_next_logprobs):
    labels = [tokens(serve_app, " yes")[0], tokens(serve_app, " no")[0], tokens(serve_app, " maybe")[0]]
    texts = [" Let me think.", " The answer:", " Well"]
    query_ids, item_ids = tokens(serve_app, QUERY), [tokens(serve_app, text) for text in texts]
    for items, item_first, apply_softmax in ((texts, False, True), (item_ids, True, False)):  # texts or token ids
        body = {"model": MODEL, "query": QUERY, "items": items, "label_token_ids": labels,
                "item_first": item_first, "apply_softmax": apply_softmax}
        r = post(serve_app, "/generative_scoring", body)
        assert r.status_code == 200, r.text
        result = r.json()
        assert [d["index"] for d in result["data"]] == [0, 1, 2] and result["object"] == "list"
        prompts = [ids + query_ids if item_first else query_ids + ids for ids in item_ids]
        assert result["usage"] == {"prompt_tokens": sum(map(len, prompts)), "completion_tokens": 3,
                                   "total_tokens": sum(map(len, prompts)) + 3}
        for prompt, scored in zip(prompts, result["data"]):
            reference = hf_next_logprobs(prompt)[labels]
            want = (reference.softmax(-1)[0] if apply_softmax else reference[0].exp()).item()
            assert math.isclose(scored["score"], want, rel_tol=1e-3, abs_tol=1e-6), (item_first, scored, want)


def test_a_prompt_longer_than_the_context_keeps_its_first_tokens(llm32):
    """The engine's input half on the request's own prompts and parameters, without running them (an 8k-token
    prefill in fp32 costs half a minute here): query then item, or item then query, cut to the context less one."""
    query, item = list(range(100, 120)), list(range(1000, 1000 + 9000))
    body = GenerativeScoringRequest(query=query, items=[item], label_token_ids=[5])
    context = llm32.inputs.limits.max_model_len
    for item_first, joined in ((False, query + item), (True, item + query)):
        body = body.model_copy(update={"item_first": item_first})
        request = llm32.inputs.process("fit", body.prompts()[0], body.sampling_params())
        assert request.prompt_token_ids == joined[: context - 1], item_first


@pytest.mark.parametrize("extra,field", [
    ({"label_token_ids": [10 ** 7]}, "label_token_ids"), ({"label_token_ids": [-1]}, "label_token_ids.0"),
    ({"label_token_ids": []}, "label_token_ids"), ({"items": []}, "items"), ({"query": [10 ** 7]}, "query"),
    ({"items": [[5], [10 ** 7]]}, "items[1]"), ({"query": "", "items": [""]}, "query"),
    ({"temperature": 0.5}, "temperature"), ({"items": ["x"] * 65}, "items"),
])
def test_what_cannot_be_scored_is_a_400_naming_the_field(serve_app, extra, field):
    body = {"query": QUERY, "items": ["a"], "label_token_ids": [5], **extra}
    r = post(serve_app, "/generative_scoring", body)
    assert r.status_code == 400 and r.json()["error"]["param"] == field, r.text


def test_the_readme_table_lists_every_field_the_route_takes():
    text = README.read_text()
    table = text[text.index("<!-- generative-scoring-fields:start -->"):text.index("<!-- generative-scoring-fields:end -->")]
    listed = {m[1] for m in (re.match(r"^\| `(\w+)` \|", line) for line in table.splitlines()) if m}
    assert listed == set(GenerativeScoringRequest.model_fields)


def test_the_route_needs_the_key(serve_app):
    r = httpx.post(serve_app["base_url"] + "/generative_scoring", json={"query": "q", "items": ["a"],
                                                                        "label_token_ids": [5]}, timeout=30)
    assert r.status_code == 401, r.text
