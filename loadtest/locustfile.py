"""OpenAI-style Locust users: chat and completions, streaming and not.

Locust's own timing of a streamed request stops at the headers, so each request is timed from its body instead
(HttpUser + stream=True + iter_lines(); FastHttpUser buffers the stream, see design.md section 8) and reported as
custom events: "TTFT" and "E2E" entries in Locust's stats, plus one raw JSON record per request (--records-file)
that loadtest.run turns into the report.

Standalone: locust -f loadtest/locustfile.py --host http://127.0.0.1:8000 (options below: --max-tokens ...).
"""
from __future__ import annotations

import itertools
import json
import os
import random
import time
from dataclasses import asdict, dataclass

import gevent
from locust import HttpUser, between, constant, events, task
from requests.adapters import HTTPAdapter

from loadtest.prompts import Prompt, load_prompts


@dataclass
class Record:
    """One request as the client saw it. Times are seconds; ttft is None unless streamed."""

    start: float
    kind: str
    ok: bool
    reason: str
    status: int
    e2e: float
    ttft: float | None
    prompt_tokens: int
    completion_tokens: int

    @property
    def itl(self) -> float | None:
        if self.ttft is None or self.completion_tokens < 2:
            return None
        return (self.e2e - self.ttft) / (self.completion_tokens - 1)

    def as_dict(self) -> dict:
        return {**asdict(self), "itl": self.itl}


@events.init_command_line_parser.add_listener
def add_options(parser):
    parser.add_argument("--max-tokens", type=int, default=128, help="max_tokens of every request (natural stop)")
    parser.add_argument("--stream-share", type=float, default=0.75, help="share of requests sent with stream=true")
    parser.add_argument("--api-key", default=os.environ.get("LLM_SERVE_API_KEY", ""), help="bearer key, if the server wants one")
    parser.add_argument("--rate", type=float, default=0.0, help="open loop: requests/s (0: closed loop, one per user)")
    parser.add_argument("--arrival", choices=["poisson", "fixed"], default="poisson", help="open-loop arrival process")
    parser.add_argument("--prompt-seed", type=int, default=0)
    parser.add_argument("--model", default="", help="model field; several, comma-separated: each user sends them in "
                                                     "turn (an app serving several models); empty: omitted")
    parser.add_argument("--records-file", default="", help="append one JSON line per finished request (loadtest.run reads it)")


@events.init.add_listener
def on_init(environment, **_):
    opts = environment.parsed_options
    path = opts.records_file if opts else ""
    environment.llm_records = open(path, "a", buffering=1) if path else None  # line-buffered: progress is visible
    environment.llm_prompts = load_prompts(seed=opts.prompt_seed if opts else 0)  # once, shared by every user


def options(environment):
    return environment.parsed_options


class OpenAIClient:
    """The request logic shared by both user classes."""

    def __init__(self, user: HttpUser):
        self.user = user
        opts = options(user.environment)
        self.prompts: list[Prompt] = user.environment.llm_prompts
        self.rng = random.Random()
        models = [name for name in opts.model.split(",") if name]
        self.models = itertools.islice(itertools.cycle(models), self.rng.randrange(len(models) or 1), None)
        self.several_models = len(models) > 1
        self.headers = {"Authorization": f"Bearer {opts.api_key}"} if opts.api_key else {}

    def send(self) -> None:
        opts = options(self.user.environment)
        prompt = self.rng.choice(self.prompts)
        stream = self.rng.random() < opts.stream_share
        chat = prompt.kind != "summary" or self.rng.random() < 0.5  # summaries go to both endpoints
        body = {"max_tokens": opts.max_tokens, "stream": stream}
        model = next(self.models, None)
        if model:
            body["model"] = model
        if chat:
            path, body["messages"] = "/v1/chat/completions", prompt.messages
        else:
            path, body["prompt"] = "/v1/completions", prompt.text
        if stream:
            body["stream_options"] = {"include_usage": True}
        name = f"{'chat' if chat else 'completion'}{' stream' if stream else ''}"
        name += f" {model}" if self.several_models else ""  # Locust's stats by model too
        record = self._stream(path, body, name) if stream else self._plain(path, body, name)
        self._report(record, name)

    def _plain(self, path: str, body: dict, name: str) -> Record:
        start = time.time()
        t0 = time.perf_counter()
        with self.user.client.post(path, json=body, headers=self.headers, name=name, catch_response=True) as r:
            e2e = time.perf_counter() - t0
            try:
                usage = r.json()["usage"] if r.status_code == 200 else {}
            except ValueError:
                usage = {}
            ok = r.status_code == 200 and bool(usage)
            reason = "ok" if ok else (f"HTTP {r.status_code}" if r.status_code != 200 else "no usage in body")
            r.success() if ok else r.failure(reason)
        return Record(start, name, ok, reason, r.status_code, e2e, None, usage.get("prompt_tokens", 0), usage.get("completion_tokens", 0))

    def _stream(self, path: str, body: dict, name: str) -> Record:
        start = time.time()
        t0 = time.perf_counter()
        ttft, usage, reason, done = None, {}, "ok", False
        with self.user.client.post(path, json=body, headers=self.headers, name=name, stream=True, catch_response=True) as r:
            try:
                if r.status_code != 200:
                    reason = f"HTTP {r.status_code}"
                else:
                    for line in r.iter_lines(decode_unicode=True):
                        if not line or not line.startswith("data: "):
                            continue
                        data = line[len("data: "):]
                        if data == "[DONE]":
                            done = True
                            break
                        event = json.loads(data)
                        if "error" in event:
                            reason = f"error chunk: {event['error'].get('message', '')[:80]}"
                            break
                        if ttft is None and _has_text(event):
                            ttft = time.perf_counter() - t0
                        usage = event.get("usage") or usage
                    if reason == "ok" and not done:
                        reason = "truncated stream"
            except Exception as exc:  # a reset connection mid-stream is a failed request, not a crashed user
                reason = f"stream broke: {type(exc).__name__}"
            e2e = time.perf_counter() - t0
            ok = reason == "ok"
            r.success() if ok else r.failure(reason)
        return Record(start, name, ok, reason, r.status_code, e2e, ttft, usage.get("prompt_tokens", 0), usage.get("completion_tokens", 0))

    def _report(self, record: Record, name: str) -> None:
        env = self.user.environment
        if env.llm_records is not None:
            env.llm_records.write(json.dumps(record.as_dict()) + "\n")
        if not record.ok:
            return
        fire = env.events.request.fire
        fire(request_type="E2E", name=name, response_time=record.e2e * 1000, response_length=record.completion_tokens,
             exception=None, context={})
        if record.ttft is not None:
            fire(request_type="TTFT", name=name, response_time=record.ttft * 1000, response_length=0, exception=None, context={})


def _has_text(event: dict) -> bool:
    for choice in event.get("choices") or []:
        if choice.get("text") or (choice.get("delta") or {}).get("content"):
            return True
    return False


class ChatUser(HttpUser):
    """Closed loop: each user sends its next request as soon as the last one finished."""

    wait_time = constant(0)

    def on_start(self):
        self.api = OpenAIClient(self)

    @task
    def request(self):
        self.api.send()


class OpenLoopUser(HttpUser):
    """Open loop: one user dispatches requests at --rate per second (Poisson or fixed gaps), never waiting on them."""

    wait_time = between(0, 0)
    fixed_count = 1

    def on_start(self):
        self.api = OpenAIClient(self)
        self.rng = random.Random(1)
        self.client.mount("http://", HTTPAdapter(pool_maxsize=1024))  # many requests in flight on one session

    @task
    def dispatch(self):
        opts = options(self.environment)
        rate = opts.rate
        next_at = time.perf_counter()
        while True:
            gevent.spawn(self.api.send)
            gap = self.rng.expovariate(rate) if opts.arrival == "poisson" else 1.0 / rate
            next_at += gap
            gevent.sleep(max(0.0, next_at - time.perf_counter()))
