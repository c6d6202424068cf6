"""LLM: the offline API, generate or chat for a list of prompts and return when all are done."""
from __future__ import annotations

import uuid
from typing import Any

from tqdm.auto import tqdm

from engine.config import EngineConfig
from engine.errors import EngineInputError
from engine.input_processor import Messages, Prompt
from engine.llm_engine import LLMEngine
from engine.sampling_params import SamplingParams
from engine.sequence import RequestOutput


class LLM:

    def __init__(self, model: str | None = None, **kwargs: Any):
        config = EngineConfig(**({"model": model} if model else {}), **kwargs)
        self.engine = LLMEngine(config)

    def generate(self, prompts: list[Prompt], params: SamplingParams | list[SamplingParams] | None = None,
                 use_tqdm: bool = True) -> list[RequestOutput]:
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        params_list = params if isinstance(params, list) else [params or SamplingParams()] * len(prompts)
        if len(params_list) != len(prompts):
            raise EngineInputError(f"got {len(params_list)} SamplingParams for {len(prompts)} prompts", "params")
        ids = [f"offline-{uuid.uuid4().hex}" for _ in prompts]
        for request_id, prompt, p in zip(ids, prompts, params_list):
            self.engine.add_request(request_id, prompt, p)
        finals: dict[str, RequestOutput] = {}
        with tqdm(total=len(prompts), desc="generate", unit="req", disable=not use_tqdm) as bar:
            while self.engine.has_unfinished_requests():
                for out in self.engine.step():
                    if out.finished:
                        finals[out.request_id] = out
                        bar.update(1)
        return [finals[request_id] for request_id in ids]

    def chat(self, conversations: list[Messages], params: SamplingParams | list[SamplingParams] | None = None,
             use_tqdm: bool = True) -> list[RequestOutput]:
        if conversations and isinstance(conversations[0], dict):
            conversations = [conversations]
        return self.generate(list(conversations), params, use_tqdm)
