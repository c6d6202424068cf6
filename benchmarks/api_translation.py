"""What the Responses and Messages fronts cost the ingress beside the chat route they are built on: the request's
translation (validate, build the chat request) and each streamed token's chunk retold as their events, in
microseconds, medians of several runs. Pure Python on one core; no engine, no HTTP.

python benchmarks/api_translation.py [--runs 5] [--requests 2000] [--chunks 20000]
"""
from __future__ import annotations

import asyncio
import statistics
import time

import typer
from rich.console import Console
from rich.table import Table

from serve_app import messages_api_output, responses_api_output
from serve_app.messages_api import MessagesRequest
from serve_app.openai_protocol import ChatCompletionRequest
from serve_app.responses import sse
from serve_app.responses_api import ResponsesRequest

app = typer.Typer(add_completion=False)
SYSTEM = "You are a helpful assistant. Answer briefly."
TURNS = [{"role": "user", "content": "What is the weather in Oslo?"},
         {"role": "assistant", "content": "It is 4 C and cloudy."}, {"role": "user", "content": "And tomorrow?"}]
TOOL = {"name": "get_weather", "description": "the weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}
CHAT = {"model": "m", "max_tokens": 64, "temperature": 0.7, "stream": True,
        "messages": [{"role": "system", "content": SYSTEM}, *TURNS], "tools": [{"type": "function", "function": TOOL}]}
RESPONSES = {"model": "m", "max_output_tokens": 64, "temperature": 0.7, "stream": True, "instructions": SYSTEM,
             "input": TURNS, "tools": [{"type": "function", **TOOL}]}
MESSAGES = {"model": "m", "max_tokens": 64, "temperature": 0.7, "stream": True, "system": SYSTEM, "messages": TURNS,
            "tools": [{"name": TOOL["name"], "description": TOOL["description"], "input_schema": TOOL["parameters"]}]}
USAGE = {"prompt_tokens": 40, "completion_tokens": 1, "total_tokens": 41}


def chunk(k: int) -> dict:
    return {"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 0, "model": "m", "usage": USAGE,
            "choices": [{"index": 0, "delta": {"content": f" word{k % 10}"}, "finish_reason": None}]}


def per_request_us(make, requests: int) -> float:
    start = time.perf_counter()
    for _ in range(requests):
        make()
    return (time.perf_counter() - start) / requests * 1e6


def per_chunk_us(stream, chunks: int) -> float:
    """Each chunk through `stream(chunk_source)` (an async generator of SSE bytes), per chunk."""
    async def source():
        for k in range(chunks):
            yield chunk(k)

    async def drain():
        async for _ in stream(source()):
            pass

    start = time.perf_counter()
    asyncio.run(drain())
    return (time.perf_counter() - start) / chunks * 1e6


async def chat_sse(chunks):
    async for c in chunks:
        yield sse(c)


def measure(requests: int, chunks: int) -> dict[str, tuple[float, float]]:
    responses = ResponsesRequest.model_validate(RESPONSES)
    return {
        "chat (the base)": (per_request_us(lambda: ChatCompletionRequest.model_validate(CHAT), requests),
                            per_chunk_us(chat_sse, chunks)),
        "Responses": (per_request_us(lambda: ResponsesRequest.model_validate(RESPONSES).chat_request(), requests),
                      per_chunk_us(lambda c: responses_api_output.event_stream(c, responses, "resp_1", "m",
                                                                               lambda e, _: {}), chunks)),
        "Messages": (per_request_us(lambda: MessagesRequest.model_validate(MESSAGES).chat_request(False), requests),
                     per_chunk_us(lambda c: messages_api_output.event_stream(c, "msg_1", "m", lambda e, _: {}),
                                  chunks)),
    }


@app.command()
def main(runs: int = 5, requests: int = 2000, chunks: int = 20000) -> None:
    results = [measure(requests, chunks) for _ in range(runs)]
    table = Table(title=f"ingress CPU per request and per streamed chunk, medians of {runs} runs (us)")
    for column in ("route", "request: validate + translate", "chunk: retold as SSE"):
        table.add_column(column, justify="right" if column != "route" else "left")
    for route in results[0]:
        table.add_row(route, *(f"{statistics.median(r[route][i] for r in results):.1f}" for i in (0, 1)))
    Console().print(table)


if __name__ == "__main__":
    app()
