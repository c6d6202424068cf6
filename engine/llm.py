"""LLM: the offline API, generate or chat for a list of prompts and return when all are done. The front end's two
halves (input_processor.py, output_processor.py) around an EngineCore (core_protocol.py): by default the inline core,
stepped on the calling thread; with `engine_process`, the core process, whose steps arrive on its receiver thread."""
from __future__ import annotations

import queue
import time
import uuid
from collections.abc import Callable
from typing import Any

from tqdm.auto import tqdm

from engine.beam_search import BeamSearchOutput, BeamSearchParams
from engine.chat import DEFAULT_OPTIONS, ChatOptions
from engine.config import EngineConfig, read_chat_template
from engine.core_inline import InlineCore
from engine.core_messages import CoreOutput
from engine.core_protocol import EngineCore
from engine.errors import EngineDeadError, EngineInputError
from engine.input_processor import InputProcessor, Messages, Prompt
from engine.llm_engine import LLMEngine
from engine.models import load_tokenizer
from engine.output_processor import OutputProcessor, RequestOutput
from engine.pooling_params import PoolingParams
from engine.sampling_params import SamplingParams
from engine.scoring import check_pairs, cosine_scores
from engine.step_stats import heap_frozen_during


class LLM:

    def __init__(self, model: str | None = None, config: EngineConfig | None = None, **kwargs: Any):
        if config is None:
            config = EngineConfig(**({"model": model} if model else {}), **kwargs)
        elif model or kwargs:
            raise TypeError("give LLM either a config or the fields of one, not both")
        self._delivered: queue.SimpleQueue[list[CoreOutput] | EngineDeadError] = queue.SimpleQueue()
        # step()'s time in the front end (detokenizing, stop strings): with an inline core, host time between steps
        self.front_end_seconds = 0.0
        self.core: EngineCore
        if config.engine_process:
            from engine.core_client import ProcessCore

            self.core = ProcessCore(config, self._delivered.put, self._die)
            tokenizer = load_tokenizer(config)
        else:
            self.core = InlineCore(config, self._delivered.put, self._die)
            tokenizer = self.core.engine.tokenizer  # the core runs on this thread too: one tokenizer serves both
        self.inputs = InputProcessor(config, tokenizer, self.core.limits, self.core.grammars)
        self.outputs = OutputProcessor(tokenizer, self.core.limits.eos_token_ids)
        self.core.start()

    @property
    def engine(self) -> LLMEngine:
        """The inline core's engine, whose parts tests and benchmarks read (not there with a core process)."""
        return self.core.engine

    def generate(self, prompts: list[Prompt], params: SamplingParams | list[SamplingParams] | None = None,
                 use_tqdm: bool = True, priority: list[int] | None = None,
                 lora_name: str | list[str | None] | None = None) -> list[RequestOutput]:
        """Each prompt's final output, in order. `priority`: one per prompt, under the priority policy (vLLM's);
        `lora_name`: the LoRA adapter of every prompt, or one per prompt (None: the base model), as vLLM's
        `lora_request`."""
        return self._run(_as_batch(prompts), params, use_tqdm, priority, lora_name=lora_name)

    def chat(self, conversations: list[Messages] | Messages,
             params: SamplingParams | list[SamplingParams] | None = None, use_tqdm: bool = True,
             tools: list[dict] | None = None, add_generation_prompt: bool = True,
             continue_final_message: bool = False, chat_template_kwargs: dict[str, Any] | None = None,
             priority: list[int] | None = None, lora_name: str | list[str | None] | None = None,
             chat_template: str | None = None) -> list[RequestOutput]:
        """Each conversation's final output, rendered by the model's chat template as vLLM's LLM.chat does: with
        `tools` offered, the assistant's turn opened or the last message continued, extra template variables;
        `chat_template`, a template (its text or a file's path) in place of the engine's."""
        if conversations and isinstance(conversations[0], dict):
            conversations = [conversations]
        template = read_chat_template(chat_template) if chat_template is not None else None
        options = ChatOptions(add_generation_prompt, continue_final_message, chat_template_kwargs or {},
                              template=template)
        return self._run(list(conversations), params, use_tqdm, priority, tools, options, lora_name)

    def get_default_sampling_params(self) -> SamplingParams:
        """What a prompt given no SamplingParams samples with: the model's generation config (vLLM's method)."""
        return self.inputs.default_params

    def beam_search(self, prompts: list[Prompt] | Prompt, params: BeamSearchParams,
                    use_tqdm: bool = True) -> list[BeamSearchOutput]:
        """Each prompt's beams, best first, as vLLM's LLM.beam_search (engine/beam_search.py): every step, each
        prompt's live beams run as one-token requests, all prompts in one batch."""
        searches = [self.inputs.beam_search(prompt, params) for prompt in _as_batch(prompts)]
        step_params = params.step_params()  # every search's: they differ in max_tokens alone
        cached: list[int | None] = [None] * len(searches)
        with tqdm(total=len(searches), desc="beam search", unit="req", disable=not use_tqdm) as bar, \
                heap_frozen_during():
            while live := [i for i, search in enumerate(searches) if not search.done]:
                asked = {i: [f"beam-{uuid.uuid4().hex}" for _ in searches[i].live] for i in live}
                added: list[str] = []
                try:
                    for i in live:
                        for request_id, tokens in zip(asked[i], searches[i].beam_prompts()):
                            self.add_request(request_id, tokens, step_params, final_only=True)
                            added.append(request_id)
                except BaseException:  # a step refused (a full queue) must not leave its other beams running
                    self._withdraw(added)
                    raise
                finals = self._finals()
                for i in live:
                    answers = [finals[request_id].checked() for request_id in asked[i]]
                    cached[i] = answers[0].num_cached_tokens if cached[i] is None else cached[i]
                    searches[i].advance([answer.logprobs[0] for answer in answers])
                    bar.update(searches[i].done)
        tokenizer = self.inputs.tokenizer
        return [search.result(lambda ids: tokenizer.decode(ids, skip_special_tokens=params.skip_special_tokens),
                              hit or 0) for search, hit in zip(searches, cached)]

    def embed(self, prompts: list[Prompt] | Prompt, pooling_params: PoolingParams | None = None, use_tqdm: bool = True,
              lora_name: str | list[str | None] | None = None) -> list[RequestOutput]:
        """Each prompt's embedding (`.embedding`), in order, as vLLM's LLM.embed: the final hidden state of its last
        token, unit length by default (PoolingParams says otherwise)."""
        return self._run(_as_batch(prompts), None, use_tqdm, None, lora_name=lora_name,
                         pooling=pooling_params or PoolingParams())

    def score(self, text_1: Prompt | list[Prompt], text_2: Prompt | list[Prompt], truncate_prompt_tokens: int | None = None,
              use_tqdm: bool = True, lora_name: str | None = None) -> list[float]:
        """As vLLM's LLM.score with a model that embeds: each pair's cosine similarity of embeddings, for one text_1
        against each text_2, or text_1 and text_2 lists of one length pair by pair."""
        firsts, seconds = _as_batch(text_1), _as_batch(text_2)
        check_pairs(len(firsts), len(seconds))
        outputs = self.embed(firsts + seconds, PoolingParams(truncate_prompt_tokens=truncate_prompt_tokens), use_tqdm,
                             lora_name)
        return cosine_scores([o.embedding_f32 for o in outputs], len(firsts))

    def _run(self, prompts: list[Prompt], params: SamplingParams | list[SamplingParams] | None, use_tqdm: bool,
             priority: list[int] | None, tools: list[dict] | None = None,
             options: ChatOptions = DEFAULT_OPTIONS,
             lora_name: str | list[str | None] | None = None, pooling: PoolingParams | None = None) -> list[RequestOutput]:
        params_list = params if isinstance(params, list) else [params] * len(prompts)
        if len(params_list) != len(prompts):
            raise EngineInputError(f"got {len(params_list)} SamplingParams for {len(prompts)} prompts", "params")
        priorities = priority if priority is not None else [0] * len(prompts)
        if len(priorities) != len(prompts):
            raise EngineInputError(f"got {len(priorities)} priorities for {len(prompts)} prompts", "priority")
        adapters = lora_name if isinstance(lora_name, list) else [lora_name] * len(prompts)
        if len(adapters) != len(prompts):
            raise EngineInputError(f"got {len(adapters)} lora names for {len(prompts)} prompts", "lora_name")
        ids = [f"offline-{uuid.uuid4().hex}" for _ in prompts]
        for added, (request_id, prompt, p, rank, adapter) in enumerate(zip(ids, prompts, params_list, priorities,
                                                                           adapters)):
            try:
                self.add_request(request_id, prompt, p, tools=tools, final_only=True, priority=rank, options=options,
                                 lora_name=adapter, pooling=pooling)
            except BaseException:  # one refused prompt refuses the batch: the ones before it must not run on
                self._withdraw(ids[:added])
                raise
        with (tqdm(total=len(prompts), desc="embed" if pooling else "generate", unit="req", disable=not use_tqdm) as bar,
              heap_frozen_during()):
            finals = self._finals(lambda: bar.update(1))
        return [finals[request_id] for request_id in ids]

    def _withdraw(self, request_ids: list[str]) -> None:
        """Stop requests already added, and report on them no more."""
        for request_id in request_ids:
            self.abort(request_id)
            self.outputs.forget(request_id)

    def _finals(self, each: Callable[[], None] = lambda: None) -> dict[str, RequestOutput]:
        """Step until no request is left: each one's final output by its id."""
        finals: dict[str, RequestOutput] = {}
        while self.has_unfinished_requests():
            for out in self.step():
                if out.finished:
                    finals[out.request_id] = out
                    each()
        return finals

    # -- one request at a time, one step at a time ----------------------------------------------------

    def add_request(self, request_id: str, prompt: Prompt, params: SamplingParams | None = None,
                    cache_salt: str | None = None, tools: list[dict] | None = None,
                    prompt_leader: str | None = None, final_only: bool = False, priority: int = 0,
                    options: ChatOptions = DEFAULT_OPTIONS, lora_name: str | None = None,
                    pooling: PoolingParams | None = None) -> None:
        """Validate, tokenize and enqueue (EngineInputError names the field at fault). Requests with a `cache_salt`
        share prefix-cache blocks only with requests carrying the same salt; one naming a `prompt_leader` (an
        earlier request with the same prompt, as the choices of n > 1 are) shares that request's prompt blocks.
        With `final_only`, `step` reports the request once, finished; `lora_name` names the LoRA adapter that runs it;
        `pooling` makes it an embedding request (no `params`)."""
        request = self.inputs.process(request_id, prompt, params, cache_salt=cache_salt, tools=tools,
                                      prompt_leader=prompt_leader, priority=priority, options=options,
                                      lora_name=lora_name, pooling=pooling)
        self.outputs.add(request, final_only)
        try:
            self.core.add(request)
        except BaseException:
            self.outputs.forget(request_id)
            raise

    def step(self) -> list[RequestOutput]:
        """One engine step's outputs: the inline core steps here; a core process's next step is waited for."""
        inline = isinstance(self.core, InlineCore)
        if inline:
            self.core.step()
        delivered = self._take_delivered(wait=not inline)
        started = time.perf_counter()
        outputs, ended = self.outputs.process(delivered)
        self.front_end_seconds += time.perf_counter() - started
        for request_id, reason in ended.items():
            self.core.abort(request_id, reason)
        return outputs

    def abort(self, request_id: str) -> None:
        self.core.abort(request_id)

    def has_unfinished_requests(self) -> bool:
        """Requests the front end still reports on, or the core still holds (one ended here on a stop string)."""
        return bool(self.outputs.requests) or self.core.has_unfinished_requests()

    def shutdown(self) -> None:
        self.core.shutdown()

    def _take_delivered(self, wait: bool) -> list[CoreOutput]:
        """Every step's outputs delivered so far; with `wait`, at least one step's (a core process reports idle
        loops too, with no outputs)."""
        items = []
        if wait:
            try:
                items.append(self._delivered.get(timeout=self.core.config.step_timeout_s))
            except queue.Empty:
                raise EngineDeadError(f"no engine step finished in {self.core.config.step_timeout_s:g} s") from None
        while not self._delivered.empty():
            items.append(self._delivered.get_nowait())
        taken: list[CoreOutput] = []
        for item in items:
            if isinstance(item, EngineDeadError):
                raise item
            taken.extend(item)
        return taken

    def _die(self, reason: str) -> None:
        self._delivered.put(EngineDeadError(reason))


def _as_batch(prompts: list[Prompt] | Prompt) -> list[Prompt]:
    """A list of prompts, where one prompt (a text or a list of token ids) may stand for a batch of one."""
    return [prompts] if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)) else prompts
