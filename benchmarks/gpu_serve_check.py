"""The served app on a GPU machine (`make gpu-serve-check`): what `make gpu-check` does not reach, Ray Serve in front
of the engine on the device, deployed from `serve_app/config.gpu.yaml`'s args, in one process tree and a few minutes.

1. A random Qwen2.5-1.5B-shaped bf16 model on the synthetic tokenizer's vocabulary (every token it draws is text).
2. The engine alone on the load's workload, in a child process: the tok/s the served app is held to.
3. A local Ray on loopback (token auth, Serve's Python proxy: the GPU image has no HAProxy) and the app as
   config.gpu.yaml builds it (colocated, one replica on the GPU, an API key), the random model swapped in.
4. Over HTTP: 401 without the key; a chat completion; a stream, its usage chunk last; a JSON-schema reply that
   validates; a Responses API reply; the engine's series on Ray's metrics endpoint.
5. Load: `concurrency` streaming chat clients for `seconds` (sampled, fixed lengths): requests, errors (none may
   fail), tok/s, time to first token and end to end at the load test's percentiles, served tok/s against the engine
   alone.

Writes `gpu_serve_check.json` and `gpu_serve_check.log` under --out; exits non-zero on any failed check. `--device
cpu` runs the same code at toy sizes (`make test-all` does), so what reaches a GPU machine has run end to end.

    python benchmarks/gpu_serve_check.py --out benchmarks/results/gpu-serve-check
"""
from __future__ import annotations

import asyncio
import json
import multiprocessing
import os
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import typer
import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from benchmarks.gpu_check import QWEN_1_5B, Log, environment  # noqa: E402

cli = typer.Typer(add_completion=False)
API_KEY = "gpu-serve-check-key"
# no free-text field: a random model fills a string until max_tokens, and a reply cut short is not JSON
SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"}, "level": {"enum": ["low", "high"]},
                                           "count": {"type": "integer", "minimum": 0, "maximum": 9}},
          "required": ["ok", "level", "count"], "additionalProperties": False}
SAMPLED = dict(temperature=0.8, top_p=0.95)  # a chat client's usual request


@dataclass
class Load:
    """The model and the load on each device: the GPU's, or toys that finish in seconds on a CPU."""

    model: dict
    concurrency: int
    max_tokens: int
    seconds: float
    engine_rounds: int  # batches of `concurrency` requests the engine alone runs


TOY = dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
           max_position_embeddings=2048, rope_theta=1000000.0, tie_word_embeddings=True, initializer_range=0.02)
LOADS = {"cuda": Load(QWEN_1_5B, 128, 128, 40, 3), "cpu": Load(TOY, 4, 8, 4, 2)}


def app_args(path: str, device: str, load: Load) -> dict:
    """config.gpu.yaml's app args, the random model swapped in, one replica, loopback; on CPU a toy engine."""
    config = yaml.safe_load((ROOT / "serve_app" / "config.gpu.yaml").read_text())
    args = config["applications"][0]["args"]
    engine = dict(args["engine_config"], model=path)
    if device == "cpu":
        engine.update(device="cpu", dtype="float32", max_num_seqs=16, max_num_batched_tokens=512, num_kv_blocks=512)
        args.update(num_gpus=0, num_cpus=1)
    return dict(args, engine_config=engine, served_model_name="llm", min_replicas=1, max_replicas=1, api_key=API_KEY)


def conversation(i: int) -> list[dict]:
    """A different first line for each request, so prefix caching does not make prefill free."""
    return [{"role": "system", "content": f"You are assistant number {i}. Answer plainly and at length."},
            {"role": "user", "content": "Describe a walk along a river in early spring: the light, the water, the "
                                        "birds, what people say to each other, and how the town changes at dusk."}]


def engine_alone(args: dict, load: Load, results) -> None:
    """The engine in this (child) process on the load's workload: rounds of `concurrency` chats at once."""
    from engine import LLM, SamplingParams
    from engine.config import EngineConfig

    config = EngineConfig(**{**args["engine_config"], "engine_process": False})
    llm = LLM(config=config)
    params = SamplingParams(max_tokens=load.max_tokens, ignore_eos=True, **SAMPLED)
    llm.chat([conversation(i) for i in range(load.concurrency)], params)  # warm: graphs, kernels, allocator
    started, tokens = time.perf_counter(), 0
    for round_ in range(load.engine_rounds):
        outputs = llm.chat([conversation(1000 * (round_ + 1) + i) for i in range(load.concurrency)], params)
        tokens += sum(o.num_tokens for o in outputs)
    seconds = time.perf_counter() - started
    results.put({"tokens": tokens, "seconds": round(seconds, 2), "tok_s": round(tokens / seconds, 1)})
    llm.shutdown()


def _result_of(child, queue, timeout_s: float = 600) -> dict:
    """What the child put on the queue; fails as soon as the child dies without it."""
    import queue as queues

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            result = queue.get(timeout=1)
        except queues.Empty:
            if not child.is_alive():
                raise RuntimeError(f"the engine-alone process exited {child.exitcode} with no result") from None
            continue
        child.join(60)
        return result
    child.kill()
    raise TimeoutError(f"the engine-alone process gave no result in {timeout_s} s")


def start_app(args: dict, device: str) -> tuple[str, int]:
    """A local Ray and the app; its base URL (healthy) and Ray's metrics port."""
    import ray
    from ray import serve

    from loadtest.loopback import free_port, wait_healthy
    from serve_app.app import build_app
    from serve_app.ray_env import setdefault_ray_env

    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))  # workers
    setdefault_ray_env(throughput=False)
    metrics_port, port = free_port(), free_port()
    ray.init(address="local", _node_ip_address="127.0.0.1", num_cpus=os.cpu_count(), num_gpus=int(device == "cuda"),
             include_dashboard=False, log_to_driver=False, object_store_memory=1 << 30,
             _metrics_export_port=metrics_port, _system_config={"metrics_report_interval_ms": 1000},
             runtime_env={"env_vars": {"HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}})
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    serve.run(build_app(args), name="llm", route_prefix="/", blocking=False)
    base = f"http://127.0.0.1:{port}"
    wait_healthy(base, 300, what="the app")
    return base, metrics_port


def functional(base: str, metrics_port: int, log: Log) -> list[str]:
    """The checks a client relies on, each a failure message where it does not hold."""
    import httpx
    import jsonschema

    failures, auth = [], {"Authorization": f"Bearer {API_KEY}"}
    chat = dict(model="llm", messages=conversation(0), max_tokens=16)
    with httpx.Client(base_url=base, timeout=120) as client:
        if (status := client.post("/v1/chat/completions", json=chat).status_code) != 401:
            failures.append(f"without the key: {status}, not 401")
        whole = client.post("/v1/chat/completions", json=chat, headers=auth).json()
        if whole.get("usage", {}).get("completion_tokens", 0) < 1 or not whole.get("choices"):
            failures.append(f"chat completion: {whole}")
        chunks = []
        with client.stream("POST", "/v1/chat/completions", headers=auth,
                           json=dict(chat, stream=True, stream_options={"include_usage": True})) as stream:
            for line in stream.iter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    chunks.append(json.loads(line[6:]))
        if len(chunks) < 2 or chunks[-1].get("usage", {}).get("completion_tokens", 0) < 1:
            failures.append(f"stream: {len(chunks)} chunks, the last {chunks[-1:]}")
        schema = {"type": "json_schema", "json_schema": {"name": "item", "schema": SCHEMA}}
        structured = client.post("/v1/chat/completions", headers=auth,
                                 json=dict(chat, max_tokens=64, response_format=schema))
        try:
            jsonschema.validate(json.loads(structured.json()["choices"][0]["message"]["content"]), SCHEMA)
        except Exception as error:  # any way it fails is the failure
            failures.append(f"json_schema reply: {type(error).__name__}: {error}; {structured.text[:300]}")
        response = client.post("/v1/responses", headers=auth, json=dict(
            model="llm", input=conversation(0), max_output_tokens=16)).json()
        if response.get("object") != "response" or response.get("usage", {}).get("output_tokens", 0) < 1:
            failures.append(f"responses API: {str(response)[:300]}")
    deadline = time.monotonic() + 30  # Ray exports every second here (metrics_report_interval_ms)
    while "ray_engine_generation_tokens_total" not in (text := _metrics(metrics_port)) and time.monotonic() < deadline:
        time.sleep(1)
    if "ray_engine_generation_tokens_total" not in text:
        failures.append("no ray_engine_generation_tokens_total on Ray's metrics endpoint")
    log(f"functional checks: {'passed' if not failures else failures}")
    return failures


def _metrics(port: int) -> str:
    import httpx

    try:
        return httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text
    except httpx.HTTPError:
        return ""


async def _client(client, load: Load, index: int, stop: float, rows: list, errors: list) -> None:
    body = dict(model="llm", max_tokens=load.max_tokens, ignore_eos=True, stream=True,
                stream_options={"include_usage": True}, **SAMPLED)
    turn = 0
    while time.monotonic() < stop:
        started, first, tokens = time.monotonic(), None, 0
        try:
            async with client.stream("POST", "/v1/chat/completions",
                                     json=dict(body, messages=conversation(10_000 * index + turn))) as response:
                if response.status_code != 200:
                    errors.append(f"{response.status_code}: {(await response.aread())[:200]!r}")
                    continue
                async for line in response.aiter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    chunk = json.loads(line[6:])
                    if first is None and chunk.get("choices") and chunk["choices"][0]["delta"].get("content"):
                        first = time.monotonic()
                    tokens = (chunk.get("usage") or {}).get("completion_tokens", tokens)
        except Exception as error:  # every failed request is counted, whatever it raised
            errors.append(f"{type(error).__name__}: {error}")
            continue
        rows.append((started, first or time.monotonic(), time.monotonic(), tokens))
        turn += 1


async def _load(base: str, load: Load) -> tuple[list, list, float]:
    import httpx

    rows, errors = [], []
    limits = httpx.Limits(max_connections=load.concurrency + 8)
    async with httpx.AsyncClient(base_url=base, timeout=300, limits=limits,
                                 headers={"Authorization": f"Bearer {API_KEY}"}) as client:
        stop = time.monotonic() + load.seconds
        started = time.monotonic()
        await asyncio.gather(*(_client(client, load, i, stop, rows, errors) for i in range(load.concurrency)))
        return rows, errors, time.monotonic() - started


def serve_load(base: str, load: Load, log: Log) -> dict:
    """`concurrency` clients, each sending its next streamed chat as soon as the last ends, for `seconds`."""
    from loadtest.report import percentiles

    rows, errors, wall = asyncio.run(_load(base, load))
    tokens = sum(row[3] for row in rows)
    result = {"concurrency": load.concurrency, "requests": len(rows), "errors": len(errors),
              "error_samples": errors[:5], "tokens": tokens, "seconds": round(wall, 2),
              "tok_s": round(tokens / wall, 1), "short": sum(row[3] != load.max_tokens for row in rows),
              "ttft_s": percentiles([first - start for start, first, _, _ in rows]),
              "e2e_s": percentiles([end - start for start, _, end, _ in rows])}
    log(f"served load: {result}")
    return result


@cli.command()
def main(device: str = typer.Option("cuda", help="cuda, or cpu for toy sizes"),
         out: Path = typer.Option(ROOT / "benchmarks" / "results" / "gpu-serve-check", help="the JSON and the log"),
         model_dir: Path = typer.Option(Path("/tmp/gpu-serve-check-model"), help="where the random model is written")):
    import torch

    from tests.fixtures.tiny_models import random_checkpoint, synthetic_tokenizer
    from transformers import Qwen2Config, Qwen2ForCausalLM

    out.mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    log, load = Log(out / "gpu_serve_check.log"), LOADS[device]
    report = {"environment": environment(device), "failures": [], "load": asdict(load)}
    log(f"environment: {report['environment']}")
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    path = random_checkpoint(model_dir / device, Qwen2ForCausalLM, Qwen2Config, load.model,
                             len(synthetic_tokenizer()), device, dtype)
    log(f"random model at {path}")
    args = app_args(path, device, load)
    report["app_args"] = args
    spawn = multiprocessing.get_context("spawn")  # the engine's GPU memory is the replica's once its process exits
    queue = spawn.Queue()
    child = spawn.Process(target=engine_alone, args=(args, load, queue))
    child.start()
    report["engine_alone"] = _result_of(child, queue)
    log(f"engine alone: {report['engine_alone']}")
    started = time.monotonic()
    try:
        base, metrics_port = start_app(args, device)
        report["startup_s"] = round(time.monotonic() - started, 1)
        log(f"app healthy after {report['startup_s']} s")
        report["failures"] += functional(base, metrics_port, log)
        report["served"] = served = serve_load(base, load, log)
        report["served_vs_engine_alone"] = round(served["tok_s"] / report["engine_alone"]["tok_s"], 3)
        if served["errors"] or not served["requests"] or served["short"]:
            report["failures"].append(f"load: {served['errors']} errors, {served['requests']} requests, "
                                      f"{served['short']} short of max_tokens")
    except Exception as error:  # reported with what was measured before it
        import traceback

        log(f"serving failed:\n{traceback.format_exc()}")
        report["failures"].append(f"serving: {type(error).__name__}: {error}")
    finally:
        _shutdown()
    (out / "gpu_serve_check.json").write_text(json.dumps(report, indent=2, default=str))
    log(f"{'FAILED: ' + '; '.join(report['failures']) if report['failures'] else 'all checks passed'}; "
        f"served at {report.get('served_vs_engine_alone')} of the engine alone")
    raise typer.Exit(1 if report["failures"] else 0)


def _shutdown() -> None:
    import ray
    from ray import serve

    try:
        serve.shutdown()
    finally:
        ray.shutdown()


if __name__ == "__main__":
    cli()
