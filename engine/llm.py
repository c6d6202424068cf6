"""LLM: the offline API, generate or chat for a list of prompts and return when all are done. The front end's two
halves (input_processor.py, output_processor.py) around an engine core (LLMEngine), all on the calling thread."""
from __future__ import annotations

import uuid
from typing import Any

from tqdm.auto import tqdm

from engine.config import EngineConfig
from engine.errors import EngineInputError
from engine.input_processor import InputProcessor, Messages, Prompt
from engine.llm_engine import LLMEngine
from engine.output_processor import OutputProcessor, RequestOutput
from engine.sampling_params import SamplingParams


class LLM:

    def __init__(self, model: str | None = None, config: EngineConfig | None = None, **kwargs: Any):
        if config is None:
            config = EngineConfig(**({"model": model} if model else {}), **kwargs)
        elif model or kwargs:
            raise TypeError("give LLM either a config or the fields of one, not both")
        self.engine = LLMEngine(config)
        tokenizer = self.engine.tokenizer  # one thread uses it: this one
        self.inputs = InputProcessor(config, tokenizer, self.engine.limits, self.engine.grammars)
        self.outputs = OutputProcessor(tokenizer, self.engine.limits.eos_token_ids)

    def generate(self, prompts: list[Prompt], params: SamplingParams | list[SamplingParams] | None = None,
                 use_tqdm: bool = True) -> list[RequestOutput]:
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        params_list = params if isinstance(params, list) else [params or SamplingParams()] * len(prompts)
        if len(params_list) != len(prompts):
            raise EngineInputError(f"got {len(params_list)} SamplingParams for {len(prompts)} prompts", "params")
        ids = [f"offline-{uuid.uuid4().hex}" for _ in prompts]
        for request_id, prompt, p in zip(ids, prompts, params_list):
            self.add_request(request_id, prompt, p)
        finals: dict[str, RequestOutput] = {}
        with tqdm(total=len(prompts), desc="generate", unit="req", disable=not use_tqdm) as bar:
            while self.has_unfinished_requests():
                for out in self.step():
                    if out.finished:
                        finals[out.request_id] = out
                        bar.update(1)
        return [finals[request_id] for request_id in ids]

    def chat(self, conversations: list[Messages], params: SamplingParams | list[SamplingParams] | None = None,
             use_tqdm: bool = True) -> list[RequestOutput]:
        if conversations and isinstance(conversations[0], dict):
            conversations = [conversations]
        return self.generate(list(conversations), params, use_tqdm)

    # -- one request at a time, one step at a time ----------------------------------------------------

    def add_request(self, request_id: str, prompt: Prompt, params: SamplingParams | None = None,
                    cache_salt: str | None = None, tools: list[dict] | None = None,
                    prompt_leader: str | None = None) -> None:
        """Validate, tokenize and enqueue (EngineInputError names the field at fault). Requests with a `cache_salt`
        share prefix-cache blocks only with requests carrying the same salt; one naming a `prompt_leader` (an
        earlier request with the same prompt, as the choices of n > 1 are) shares that request's prompt blocks."""
        request = self.inputs.process(request_id, prompt, params, cache_salt=cache_salt, tools=tools,
                                      prompt_leader=prompt_leader)
        self.outputs.add(request)
        try:
            self.engine.add_request(request)
        except BaseException:
            self.outputs.forget(request_id)
            raise

    def step(self) -> list[RequestOutput]:
        outputs, ended = self.outputs.process(self.engine.step())
        for request_id, reason in ended.items():
            self.engine.abort(request_id, reason)
        return outputs

    def abort(self, request_id: str) -> None:
        self.engine.abort(request_id)

    def has_unfinished_requests(self) -> bool:
        return self.engine.has_unfinished_requests()
