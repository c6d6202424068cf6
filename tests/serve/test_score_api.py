"""vLLM's `POST /v1/score` and `/v1/rerank` on the real app under Ray Serve: each score is the cosine similarity of the
offline engine's embeddings of the two texts; rerank orders documents by it; every refused field is a 400 naming it."""
import re

import httpx
import numpy as np
import pytest

from tests.engine.test_embeddings import TEXTS

pytestmark = pytest.mark.slow
MODEL = "SmolLM2-135M-Instruct"
TOLERANCE = 1e-4  # the served engine and the offline one, both fp32, in other batch shapes
QUERY = "Which city is the capital of France?"


@pytest.fixture(scope="module")
def cosine(llm32):
    def similarity(first: str, second: str) -> float:
        a, b = (np.array(o.embedding, dtype=np.float64) for o in llm32.embed([first, second], use_tqdm=False))
        return float(a @ b / np.linalg.norm(a) / np.linalg.norm(b))
    return similarity


def post(base_url, auth, route: str, body: dict) -> httpx.Response:
    return httpx.post(f"{base_url}{route}", json=body, headers=auth, timeout=120)


def test_one_text_against_many_and_pair_by_pair(base_url, auth, cosine, tokenizer):
    one = post(base_url, auth, "/v1/score", {"model": MODEL, "text_1": QUERY, "text_2": TEXTS}).json()
    assert one["object"] == "list" and one["model"] == MODEL and one["id"].startswith("score-")
    assert [d["index"] for d in one["data"]] == list(range(len(TEXTS))) and {d["object"] for d in one["data"]} == {"score"}
    want = [cosine(QUERY, text) for text in TEXTS]
    assert np.abs(np.array([d["score"] for d in one["data"]]) - want).max() < TOLERANCE
    tokens = sum(len(tokenizer.encode(t)) for t in [QUERY, *TEXTS])
    assert one["usage"] == {"prompt_tokens": tokens, "total_tokens": tokens}

    pairs = post(base_url, auth, "/score", {"text_1": TEXTS[:3], "text_2": TEXTS[2:5]}).json()  # vLLM's other path
    assert np.abs(np.array([d["score"] for d in pairs["data"]]) - [cosine(a, b) for a, b in zip(TEXTS[:3], TEXTS[2:5])]).max() < TOLERANCE
    single = post(base_url, auth, "/v1/score", {"text_1": [TEXTS[0]], "text_2": TEXTS[0]}).json()
    assert abs(single["data"][0]["score"] - 1.0) < TOLERANCE  # a text is its own nearest


def test_rerank_orders_documents_best_first(base_url, auth, cosine):
    want = [cosine(QUERY, text) for text in TEXTS]
    best_first = sorted(range(len(TEXTS)), key=lambda i: -want[i])
    for route in ("/v1/rerank", "/rerank", "/v2/rerank"):
        r = post(base_url, auth, route, {"model": MODEL, "query": QUERY, "documents": TEXTS}).json()
        assert r["id"].startswith("rerank-") and r["model"] == MODEL and r["usage"]["total_tokens"] > 0
        assert [x["index"] for x in r["results"]] == best_first, route
        assert [x["document"]["text"] for x in r["results"]] == [TEXTS[i] for i in best_first]
        assert np.abs(np.array([x["relevance_score"] for x in r["results"]]) - sorted(want, reverse=True)).max() < TOLERANCE
    top = post(base_url, auth, "/v1/rerank", {"query": QUERY, "documents": TEXTS, "top_n": 2,
                                              "return_documents": False}).json()
    assert [x["index"] for x in top["results"]] == best_first[:2] and all("document" not in x for x in top["results"])


@pytest.mark.parametrize("route,body,param,words", [
    ("/v1/score", {"text_1": ["a", "b"], "text_2": ["c", "d", "e"]}, "text_1", "as many as text_2"),
    ("/v1/score", {"text_1": [], "text_2": "c"}, "text_1", "no text"),
    ("/v1/score", {"text_1": "a", "text_2": ["c", ""]}, "text_2", "text_2 1 is empty"),
    ("/v1/score", {"text_1": "a", "text_2": ["c"] * 2048}, "text_2", "2048"),
    ("/v1/score", {"text_1": "a", "text_2": ["b", "hi " * 9000]}, "text_2", "text_2 1 has"),
    ("/v1/score", {"text_1": "hi " * 9000, "text_2": ["b"]}, "text_1", "text_1 has"),
    ("/v1/rerank", {"query": "a", "documents": ["b", "c", "hi " * 9000]}, "documents", "documents 2 has"),
    ("/v1/score", {"text_1": "a", "text_2": "b", "use_activation": False}, "use_activation", "activation"),
    ("/v1/score", {"text_1": "a", "text_2": "b", "mm_processor_kwargs": {"x": 1}}, "mm_processor_kwargs", ""),
    ("/v1/score", {"text_1": "a", "text_2": "b", "priority": 3}, "priority", "fcfs"),
    ("/v1/rerank", {"query": "a", "documents": []}, "documents", "no text"),
    ("/v1/rerank", {"query": "", "documents": ["b"]}, "query", "empty"),
    ("/v1/rerank", {"query": "a", "documents": ["b"], "top_n": -1}, "top_n", ""),
    ("/v1/rerank", {"query": "a", "documents": ["b"], "softmax": False}, "softmax", "activation"),
    # past 64 bits it cannot travel to the engine core (msgpack): a fuzzed body got a 500 here
    ("/v2/rerank", {"query": "a", "documents": ["b"], "truncate_prompt_tokens": 10**30}, "truncate_prompt_tokens",
     "64-bit"),
])
def test_refusals_name_the_field(base_url, auth, route, body, param, words):
    r = post(base_url, auth, route, body)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and words in error["message"], error


def test_vllms_other_spellings_score_as_text_1_and_text_2_and_name_themselves_in_errors(base_url, auth):
    """queries/documents, queries/items and data_1/data_2 give text_1/text_2's scores; a second spelling, or a side
    missing, is a 400 naming a field as sent; the caller's request id and salt reach the response and the engine."""
    want = post(base_url, auth, "/v1/score", {"text_1": QUERY, "text_2": TEXTS[:3]}).json()["data"]
    for first, second in (("queries", "documents"), ("queries", "items"), ("data_1", "data_2")):
        got = post(base_url, auth, "/v1/score", {first: QUERY, second: TEXTS[:3], "cache_salt": "tenant-b",
                                                 "request_id": f"spelled-{second}"})
        assert got.status_code == 200 and got.json()["id"] == f"score-spelled-{second}", got.text
        assert [d["score"] for d in got.json()["data"]] == pytest.approx([d["score"] for d in want], abs=TOLERANCE)
    for body, param in (({"queries": "a", "documents": "b", "items": "c"}, "documents"),
                        ({"text_1": "a", "data_2": "b"}, "data_2"), ({"queries": "a"}, "queries"),
                        ({"queries": ["a", "b"], "items": ["c"]}, "queries"),
                        ({"queries": "a", "documents": ["b", ""]}, "documents")):
        r = post(base_url, auth, "/v1/score", body)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, (body, r.text)


def test_another_model_is_a_404_and_no_key_a_401(base_url, auth):
    r = post(base_url, auth, "/v1/rerank", {"model": "bge-reranker", "query": "a", "documents": ["b"]})
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
    assert post(base_url, {}, "/v1/score", {"text_1": "a", "text_2": "b"}).status_code == 401
    assert post(base_url, {}, "/rerank", {"query": "a", "documents": ["b"]}).status_code == 401


# What each field of the README's tables is sent as: a value that exercises it (for refused fields, one refused)
EXAMPLES = {
    "model": {"model": MODEL}, "truncate_prompt_tokens": {"truncate_prompt_tokens": 2}, "priority": {"priority": 0},
    "use_activation": {"use_activation": False}, "activation": {"activation": False}, "softmax": {"softmax": False},
    "mm_processor_kwargs": {"mm_processor_kwargs": {"size": 1}},
    "text_1": {"text_1": ["one"]}, "text_2": {"text_2": ["three", "four"]},
    "query": {"query": "which one?"}, "documents": {"documents": ["one", "two", "three"]}, "top_n": {"top_n": 1},
    "return_documents": {"return_documents": False},
    # vLLM 0.32's spellings of score's sides, in place of text_1 and text_2 (sent as null: not given)
    "queries": {"text_1": None, "text_2": None, "queries": "hello", "documents": ["there", "here"]},
    "items": {"text_1": None, "text_2": None, "queries": ["a", "b"], "items": ["c", "d"]},
    "data_1": {"text_1": None, "text_2": None, "data_1": "hello", "data_2": ["there"]},
    "data_2": {"text_1": None, "text_2": None, "data_1": ["hello"], "data_2": "there"},
    "request_id": {"request_id": "mine-3"}, "cache_salt": {"cache_salt": "tenant-a"}, "user": {"user": "u1"},
    "instruction": {"instruction": "Judge relevance."}, "chat_template_kwargs": {"chat_template_kwargs": {"a": 1}},
    "max_tokens_per_query": {"max_tokens_per_query": 8}, "max_tokens_per_doc": {"max_tokens_per_doc": 8},
    "padding": {"padding": "max_length"}, "truncation_side": {"truncation_side": "right"},
}
BASES = {"score": ("/v1/score", {"text_1": "hello", "text_2": "there"}),
         "rerank": ("/v1/rerank", {"query": "hello", "documents": ["there", "here"]})}


def field_table(route: str) -> dict[str, str]:
    from tests.serve.test_openai_fields import README

    text = README.read_text()
    table = text[text.index(f"<!-- {route}-fields:start -->"):text.index(f"<!-- {route}-fields:end -->")]
    return {m[1]: m[2] for m in (re.match(r"^\| `(\w+)` \| (\w+) \|", line) for line in table.splitlines()) if m}


@pytest.mark.parametrize("route", sorted(BASES))
def test_the_tables_list_every_field_we_send(route):
    assert set(field_table(route)) <= set(EXAMPLES) and set(BASES[route][1]) <= set(field_table(route))
    assert set(field_table(route).values()) == {"yes", "refused"}


@pytest.mark.parametrize("route,field,outcome", sorted((r, f, o) for r in BASES for f, o in field_table(r).items()))
def test_each_field_gets_its_documented_outcome(base_url, auth, route, field, outcome):
    path, base = BASES[route]
    r = post(base_url, auth, path, {**base, **EXAMPLES[field]})
    if outcome == "yes":
        assert r.status_code == 200 and (r.json().get("data") or r.json().get("results")), (field, r.text)
    else:
        assert r.status_code == 400 and r.json()["error"]["param"] == field, (field, r.text)
        assert field in r.json()["error"]["message"], r.text
