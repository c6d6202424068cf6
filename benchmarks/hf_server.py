"""The naive baseline server: transformers + FastAPI with static batching, for the load-test sweep.

Requests are collected for up to 50 ms (at most 64), then one `model.generate` runs the whole batch to its longest
max_tokens; nobody joins a running batch. A streamed request gets its whole answer as one chunk (TTFT = e2e).

python benchmarks/hf_server.py --port 8001 --threads 2
"""
from __future__ import annotations

import asyncio
import json
import time
import uuid
from dataclasses import dataclass, field

import torch
import typer
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse
from transformers import AutoModelForCausalLM, AutoTokenizer

from engine.config import DEFAULT_MODEL
from engine.models import resolve_model_path

BATCH_WAIT_S = 0.05
MAX_BATCH = 64
cli = typer.Typer(add_completion=False)


@dataclass
class Job:
    text: str
    max_tokens: int
    done: asyncio.Future = field(default_factory=lambda: asyncio.get_running_loop().create_future())


class StaticBatcher:
    def __init__(self, model_path: str, dtype: torch.dtype):
        self.tokenizer = AutoTokenizer.from_pretrained(model_path, padding_side="left")
        self.model = AutoModelForCausalLM.from_pretrained(model_path, dtype=dtype, attn_implementation="sdpa").eval()
        self.pad = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else 0
        self.queue: asyncio.Queue[Job] = asyncio.Queue()

    async def run(self) -> None:
        while True:
            batch = [await self.queue.get()]
            deadline = time.monotonic() + BATCH_WAIT_S
            while len(batch) < MAX_BATCH and (left := deadline - time.monotonic()) > 0:
                try:
                    batch.append(await asyncio.wait_for(self.queue.get(), left))
                except asyncio.TimeoutError:
                    break
            try:
                results = await asyncio.to_thread(self.generate, batch)
                for job, result in zip(batch, results):
                    job.done.set_result(result)
            except Exception as exc:
                for job in batch:
                    job.done.set_exception(exc)

    @torch.inference_mode()
    def generate(self, batch: list[Job]) -> list[tuple[str, int, int, str]]:
        enc = self.tokenizer([j.text for j in batch], return_tensors="pt", padding=True, add_special_tokens=False)
        out = self.model.generate(**enc, max_new_tokens=max(j.max_tokens for j in batch), do_sample=False, pad_token_id=self.pad)
        new = out[:, enc["input_ids"].shape[1]:]
        eos = set(self.model.generation_config.eos_token_id if isinstance(self.model.generation_config.eos_token_id, list)
                  else [self.model.generation_config.eos_token_id])
        results = []
        for job, row, mask in zip(batch, new.tolist(), enc["attention_mask"]):
            ids, reason = row[: job.max_tokens], "length"
            for i, t in enumerate(ids):
                if t in eos:
                    ids, reason = ids[: i + 1], "stop"
                    break
            results.append((self.tokenizer.decode(ids, skip_special_tokens=True), int(mask.sum()), len(ids), reason))
        return results


def build(batcher: StaticBatcher, model_name: str) -> FastAPI:
    api = FastAPI()

    @api.on_event("startup")
    async def start():
        asyncio.get_running_loop().create_task(batcher.run())

    @api.get("/health")
    async def health():
        return {"status": "ok"}

    async def respond(body: dict, text: str, chat: bool):
        job = Job(text, int(body.get("max_tokens") or 128))
        await batcher.queue.put(job)
        answer, prompt_tokens, tokens, reason = await job.done
        rid, usage = f"hf-{uuid.uuid4().hex}", {"prompt_tokens": prompt_tokens, "completion_tokens": tokens,
                                                 "total_tokens": prompt_tokens + tokens}
        choice = ({"index": 0, "message": {"role": "assistant", "content": answer}, "finish_reason": reason} if chat
                  else {"index": 0, "text": answer, "finish_reason": reason})
        if not body.get("stream"):
            return JSONResponse({"id": rid, "object": "chat.completion" if chat else "text_completion",
                                 "model": model_name, "choices": [choice], "usage": usage})
        delta = ({"index": 0, "delta": {"content": answer}, "finish_reason": reason} if chat
                 else {"index": 0, "text": answer, "finish_reason": reason})

        async def events():
            yield f"data: {json.dumps({'id': rid, 'choices': [delta]})}\n\n"
            yield f"data: {json.dumps({'id': rid, 'choices': [], 'usage': usage})}\n\n"
            yield "data: [DONE]\n\n"
        return StreamingResponse(events(), media_type="text/event-stream")

    @api.post("/v1/chat/completions")
    async def chat(request: Request):
        body = await request.json()
        text = batcher.tokenizer.apply_chat_template(body["messages"], tokenize=False, add_generation_prompt=True)
        return await respond(body, text, chat=True)

    @api.post("/v1/completions")
    async def completions(request: Request):
        body = await request.json()
        return await respond(body, body["prompt"], chat=False)

    return api


@cli.command()
def main(port: int = 8001, threads: int = 2, dtype: str = "bfloat16", model: str = DEFAULT_MODEL):
    torch.set_num_threads(threads)
    batcher = StaticBatcher(resolve_model_path(model), getattr(torch, dtype))
    uvicorn.run(build(batcher, model), host="127.0.0.1", port=port, log_level="warning")


if __name__ == "__main__":
    cli()
