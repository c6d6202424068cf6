"""LLMEngine, the engine core: one step() = schedule -> forward -> sample -> append, check stops, free. It takes
validated requests of token ids (EngineRequest) and returns each step's new token ids (CoreOutput); the front end
(input_processor.py, output_processor.py) tokenizes, detokenizes and checks stop strings."""
from __future__ import annotations

import logging
import time
from typing import Any

import torch
from tqdm.auto import tqdm

from engine import async_scheduling
from engine.async_scheduling import InFlight
from engine.attention_backend import choose_attention_backend
from engine.block_manager import BlockManager
from engine.config import EngineConfig
from engine.core_messages import CoreOutput, EngineRequest, ModelLimits
from engine.cpu_kernels import (build_paged_decode, fused_ops, greedy_op, nucleus_mask_op, paged_decode_op,
                                paged_prefill_op)
from engine.engine_stats import EngineStats
from engine.errors import EngineInputError
from engine.host_memory import keep_freed_memory
from engine.kv_budget import device_memory_at_start, num_kv_blocks
from engine.layers.kv_cache_dtype import resolve_kv_cache_dtype
from engine.metrics import StepMetrics
from engine.pooler import embeddings
from engine.model_runner import ModelRunner, StepLogits, kv_geometry
from engine.models import (cache_root, embedding_sizes, load_hf_config, load_model, load_tokenizer, model_max_len,
                           score_shaping, resolve_device, resolve_dtype)
from engine.lora_manager import LoRAManager
from engine.request_inbox import RequestInbox
from engine.sampler import INVALID_TOKEN, NO_ALLOWED_TOKEN
from engine.sampling_defaults import sampling_defaults
from engine.sampling_params import SamplingParams
from engine.scheduler import ScheduledBatch, Scheduler
from engine.sequence import Sequence
from engine.speculative import Speculator, accepted_length
from engine.step_recovery import retry_in_groups
from engine.step_sampler import StepSampler
from engine.step_stats import GcPauses, PhaseTimer, ResidentMemory, stats_of
from engine.structured_output import GrammarCompiler
from engine.request_progress import StopChecker, core_output, new_progress

log = logging.getLogger(__name__)
PARKED_WAIT_S = 0.01  # an idle engine waits this long at a time for an adapter being loaded


class LLMEngine:
    def __init__(self, config: EngineConfig | None = None, **overrides: Any):
        self.metrics: StepMetrics | None = None  # see attach_metrics
        self.step_seconds = 0.0
        self.config = config = (config or EngineConfig()).model_copy(update=overrides) if overrides else (config or EngineConfig())
        self.claim_threads()
        self.device = resolve_device(config.device)
        memory_at_start = device_memory_at_start(config, self.device)  # before the weights: the share counts from here
        if self.device.type == "cpu":
            keep_freed_memory()
        hf_config = load_hf_config(config)
        self.dtype = resolve_dtype(config, self.device, hf_config, cache_root())
        capability = torch.cuda.get_device_capability(self.device) if self.device.type == "cuda" else None
        # refused before the weights load
        self.attention_backend = choose_attention_backend(config, self.device.type, capability,
                                                          score_shaping(hf_config))
        self.kv_dtype = resolve_kv_cache_dtype(config.kv_cache_dtype, self.dtype)
        self.model = load_model(config, self.device, self.dtype)
        self.loras = LoRAManager(self.model, config) if config.serves_lora else None  # before the runner reads them
        if self.attention_backend == "triton" and self.model.impl == "native":
            from engine.kernels.triton.fused_ops import TritonFusedOps  # imports triton: only where it runs

            self.model.use_fused_ops(TritonFusedOps())  # norms, rotary and SiLU-and-mul: one kernel each
        self.tokenizer = load_tokenizer(config)  # the core's only use of it: the grammars' vocabulary and EOS ids
        self.max_model_len = min(config.max_model_len or model_max_len(self.model.config), model_max_len(self.model.config))
        self.vocab_size = self.model.vocab_size
        if config.tokenizer is not None and len(self.tokenizer) > self.vocab_size:  # its ids past the embeddings
            raise ValueError(f"tokenizer {config.tokenizer!r} has {len(self.tokenizer)} tokens; {config.model} embeds "
                             f"{self.vocab_size}")
        self.eos_token_ids = self._eos_token_ids()
        decode_kernel = self._decode_kernel()
        fused = fused_ops() if decode_kernel is not None else None
        write_kv = fused.write_kv if fused is not None else None
        prefill_kernel = None if decode_kernel is None else \
            paged_prefill_op(self.dtype, kv_geometry(self.model.config)[2], config.block_size, self.kv_dtype)
        self.phases = PhaseTimer(cuda=self.device.type == "cuda")
        self.gc_pauses = GcPauses()
        self.resident_memory = ResidentMemory()
        self.runner = ModelRunner(self.model, config.block_size, 1, self.dtype, self.device, decode_kernel, write_kv,
                                  self.phases, triton=self.attention_backend == "triton", prefill_kernel=prefill_kernel,
                                  kv_dtype=self.kv_dtype)
        self.runner.kv_cache = self.runner.allocate_kv_cache(num_kv_blocks(config, self.runner, memory_at_start))
        # bitsandbytes' NF4/int8 kernels have never been captured here on a GPU: eager until measured
        if self.device.type == "cuda" and not config.enforce_eager and self.model.impl == "native" \
                and self.attention_backend == "triton" and config.quantization is None:
            self.runner.capture_graphs(config.max_num_seqs, self.max_model_len, gemm_tuning=config.gemm_tuning,
                                       split_tuning=config.split_tuning)
        self.block_manager = BlockManager(self.runner.num_blocks, config.block_size, config.enable_prefix_caching)
        self.scheduler = Scheduler(self.block_manager, config.max_num_seqs, config.max_num_batched_tokens,
                                   config.long_prefill_token_threshold, config.scheduling_policy == "priority")
        self.limits = ModelLimits(self.max_model_len, self.vocab_size, self.runner.num_blocks * config.block_size,
                                  sorted(self.eos_token_ids), *embedding_sizes(self.model.config),
                                  sampling_defaults(getattr(self.model, "generation_config", None), config))
        self.grammars = GrammarCompiler(self.tokenizer, self.vocab_size)  # an in-process front end shares it
        self.stops = StopChecker(self.eos_token_ids, self.max_model_len)
        on_cpu = self.device.type == "cpu"
        self.sampler = StepSampler(self.eos_token_ids, nucleus_mask_op() if on_cpu else None,
                                   greedy_op() if on_cpu else None)
        self.inbox = RequestInbox(config.max_waiting, lambda: len(self.scheduler.waiting) + len(self.parked))
        self.parked: list[Sequence] = []  # requests whose adapter is loading (lora_root), out of the scheduler
        self.speculator = Speculator(config.speculative) if config.speculative is not None else None
        # num_steps_ahead: steps launched before the step before them was read (async scheduling)
        self.counters = {"num_steps": 0, "prompt_tokens": 0, "generation_tokens": 0, "num_failed_steps": 0,
                         "num_steps_ahead": 0}
        self.consecutive_failed_steps = 0  # steps in a row that failed for the engine's sake (step_recovery.py)
        self.async_scheduling = config.async_scheduling and self.speculator is None  # see engine/async_scheduling.py
        self.in_flight: InFlight | None = None  # a launched step not yet read (async scheduling)
        self.step_started_at: float | None = None  # monotonic; None between steps
        log.info("engine ready: %s (%s model, %.0f MB of weights) on %s/%s, %d KV blocks of %d tokens in %s",
                 config.model, self.model.impl, self.model.weight_bytes() / 1e6, self.device, self.dtype,
                 self.runner.num_blocks, config.block_size, str(self.kv_dtype).removeprefix("torch."))

    # -- set-up ------------------------------------------------------------------------------------

    def claim_threads(self) -> int:
        """Set torch's thread count for the calling OS thread. Under OpenMP the count is per thread, and Ray sets
        OMP_NUM_THREADS=1, so a background step loop must call this itself or it runs on one core."""
        torch.set_num_threads(self.config.resolved_num_threads())
        return torch.get_num_threads()

    def _eos_token_ids(self) -> set[int]:
        ids = set()
        for source in (getattr(self.model, "generation_config", None), self.model.config, self.tokenizer):
            value = getattr(source, "eos_token_id", None)
            ids.update(value if isinstance(value, list) else [] if value is None else [value])
        return ids

    def _decode_kernel(self):
        if self.attention_backend != "cpp":
            return None
        if self.config.attention_backend == "cpp":
            return build_paged_decode()  # raises where it cannot build
        return paged_decode_op()  # auto: None where it cannot build

    # -- requests ----------------------------------------------------------------------------------

    def add_request(self, request: EngineRequest) -> Sequence:
        """Enqueue a request the front end validated. Thread-safe; EngineInputError for an id already in flight,
        EngineOverloadedError past max_waiting. A request naming a `prompt_leader` (an earlier request with the same
        prompt, as the choices of n > 1 are) waits for it to compute the prompt and then shares its blocks."""
        params = request.params
        if request.lora_name is not None and self.config.lora_path(request.lora_name) is None:
            raise EngineInputError(f"lora_name {request.lora_name!r} is not a LoRA adapter of this engine", "lora_name")
        grammar = self.grammars.matcher(params.structured_output) if params.structured_output else None
        seq = Sequence(request.request_id, request.prompt_token_ids, params, request.arrival_time, request.cache_salt,
                       request.priority, request.lora_name, request.pooling)
        seq.runtime = new_progress(request, grammar)
        self.inbox.put(seq, request.prompt_leader)
        return seq

    def abort(self, request_id: str, reason: str = "abort") -> None:
        """Stop a request; its blocks are freed at the start of the next step. Thread-safe. The front end ends one
        that reached a stop string with reason "stop"."""
        self.inbox.abort(request_id, reason)

    def has_unfinished_requests(self) -> bool:
        return self.inbox.has_pending or bool(self.scheduler.num_unfinished) or bool(self.parked)

    def warm_up(self) -> None:
        """One short generation before serving: first-call costs (above all compiling the decoder, with `compile`)
        stay out of user latency."""
        self.add_request(EngineRequest("warmup", [0, 1, 2, 3], SamplingParams(max_tokens=2, temperature=0.0), 2,
                                       time.monotonic()))
        with tqdm(desc="compiling the decoder", unit="step", bar_format="{desc}: {n} steps, {elapsed}",
                  disable=not self.config.compile) as bar:  # without compile it takes a tenth of a second
            while self.has_unfinished_requests():
                self.step()
                bar.update()

    # -- the step ------------------------------------------------------------------------------------

    def step(self) -> list[CoreOutput]:
        self.step_started_at = time.monotonic()
        try:
            return self._step()
        finally:
            self.step_started_at = None

    def _step(self) -> list[CoreOutput]:
        start = time.perf_counter()
        with self.phases("schedule"):
            outputs = self._drain_inbox()
        batch = ScheduledBatch()
        if self.in_flight is not None:  # async scheduling: the next step goes up before this one is read
            landing, batch = self.in_flight, self.in_flight.batch
            self.in_flight = self._launch_ahead(landing)
            outputs += self._land(landing)
        if self.in_flight is None:
            with self.phases("schedule"):
                if self.speculator is not None:
                    self.speculator.propose(self.scheduler.running, self._draft_room)
                batch = self.scheduler.schedule()
            outputs += [core_output(seq) for seq in batch.out_of_memory]
            if batch:
                run_start = time.perf_counter()
                outputs += self._run(batch)
                if self.speculator is not None:
                    self.speculator.step_ran(batch.num_new_tokens, batch.draft_token_ids, time.perf_counter() - run_start)
        self.counters["num_steps"] += 1
        for out in outputs:
            if out.finish_reason is not None:
                self.inbox.finished(out.request_id)
        if self.metrics is not None:
            self._record_metrics(outputs, batch.num_tokens)
        self.step_seconds += time.perf_counter() - start
        return outputs

    def _record_metrics(self, outputs: list[CoreOutput], step_tokens: int) -> None:
        now = time.monotonic()
        for out in outputs:
            if out.finish_reason is not None:
                self.metrics.finished(out.metrics.arrival_time, now, "error" if out.error else out.finish_reason)
        self.metrics.flush(self.stats(), step_tokens)

    def _drain_inbox(self) -> list[CoreOutput]:
        new, aborted = self.inbox.take()
        for seq in new:
            if seq.lora_name is not None and seq.lora_name not in self.loras.adapters:
                self.loras.start_loading(seq.lora_name)
                self.parked.append(seq)
                continue
            if seq.lora_name is not None:
                seq.lora_key = self.loras.use(seq.lora_name)
            self.scheduler.add(seq)
        for seq, reason in aborted:
            if seq in self.parked:
                self.parked.remove(seq)
            self.scheduler.finish(seq, reason)
        outputs = self._admit_parked() if self.parked else []
        if self.loras is not None and self.loras.past_limit:
            self.loras.drop_idle(self._adapters_in_use())
        return outputs + [core_output(seq) for seq, _ in aborted]

    def _adapters_in_use(self) -> set[str | None]:
        return {seq.lora_name for seq in (*self.scheduler.waiting, *self.scheduler.running, *self.parked)}

    def _admit_parked(self) -> list[CoreOutput]:
        """Requests whose adapter has loaded join the scheduler; those whose adapter cannot load fail alone. With
        nothing else to run, wait a little for a load rather than spin."""
        idle = not self.scheduler.num_unfinished and not self.inbox.has_pending
        loaded = self.loras.install_loaded(self._adapters_in_use(), wait_s=PARKED_WAIT_S if idle else 0.0)
        outputs, still_parked = [], []
        for seq in self.parked:
            if seq.lora_name not in loaded:
                still_parked.append(seq)
                continue
            self.scheduler.add(seq)
            error = loaded[seq.lora_name]
            if error is None:
                seq.lora_key = self.loras.use(seq.lora_name)
            else:
                outputs.append(self._fail(seq, str(error), error.param))
        self.parked = still_parked
        return outputs

    def _run(self, batch: ScheduledBatch) -> list[CoreOutput]:
        try:
            outputs = self._execute(batch, may_fly=self.async_scheduling)
        except Exception:  # one bad request must not fail its batch-mates: find it, fail it, serve the rest
            return self._retry(batch)
        self.consecutive_failed_steps = 0
        return outputs

    def _retry(self, batch: ScheduledBatch) -> list[CoreOutput]:
        """After a failed step, each of its requests again, synchronously, in ever smaller groups."""
        log.exception("engine step failed; retrying its %d requests in groups", len(batch))
        self.counters["num_failed_steps"] += 1
        outputs, engine_fault = retry_in_groups(batch, self._execute, self._fail)
        # steps in a row that failed for the engine's sake count against it; a clean step resets the count
        self.consecutive_failed_steps = self.consecutive_failed_steps + 1 if engine_fault else 0
        return outputs

    def _launch_ahead(self, landing: InFlight) -> InFlight | None:
        """Step N+1 on the device before step N (`landing`) is read, where every running sequence was in step N and
        still runs, nothing waiting could be admitted (a full batch admits no one: saturated, the queue waits), and
        the pool holds their next slots without preempting anyone. Each row flew when step N launched, and still
        does: a landing appends one token and computes one, and nothing a row's flight depends on (a grammar,
        min_tokens, logprobs) starts mid-output, so only ends, lengths and thinking countdowns (which near their
        forced token step by step) are checked (flies() for 256 rows: 70 us)."""
        seqs = [seq for seq in landing.step.seqs if not seq.is_finished]  # aborted since it launched
        bm, scheduler = self.block_manager, self.scheduler
        if (not seqs or (scheduler.waiting and len(scheduler.running) < scheduler.max_num_seqs)
                or len(scheduler.running) != len(seqs)):
            return None
        grown, block_size = [], bm.block_size  # (row, blocks it takes): about one row in block_size a step
        for row, seq in enumerate(seqs):
            length = len(seq.token_ids)
            if length >= self.max_model_len or not async_scheduling.thinking_flies(seq.runtime.thinking):
                return None
            if length >= len(seq.block_table) * block_size:  # position `length` lies past its last block
                grown.append((row, bm.blocks_needed(length + 1) - len(seq.block_table)))
        if sum(count for _, count in grown) > bm.num_free_blocks:
            return None
        for row, _ in grown:  # a grow call for every row cost 0.13 ms at batch 256
            bm.grow(seqs[row], len(seqs[row]) + 1)
        batch = ScheduledBatch.one_token_each(seqs)
        try:
            step = self.runner.execute_ahead(seqs, async_scheduling.next_input_ids(landing, seqs), landing.step.seqs,
                                             grown)
            with self.phases("sample"):
                in_flight = async_scheduling.launch(batch, step, self.sampler.on_device(step))
        except Exception:
            log.exception("launching a step ahead failed; the step before it lands first")
            return None
        self.counters["num_steps_ahead"] += 1
        return in_flight

    def _land(self, landing: InFlight) -> list[CoreOutput]:
        """Read a step launched earlier and commit its tokens; where that fails, the step again, synchronously."""
        try:
            with self.phases("sample"):
                tokens = landing.read_tokens()
            with self.phases("output"):
                outputs = self._commit(landing.batch, landing.step, {}, tokens, [None] * len(tokens))
        except Exception:
            self.in_flight = None  # it took the failed step's tokens as inputs
            batch = landing.batch
            return self._retry(batch.subset([i for i, seq in enumerate(batch.seqs) if not seq.is_finished]))
        if self.in_flight is not None and all(seq.is_finished for seq in self.in_flight.step.seqs):
            self.in_flight = None  # every row of the step ahead ended here: nothing to read
        self.consecutive_failed_steps = 0
        return outputs

    def _execute(self, batch: ScheduledBatch, may_fly: bool = False) -> list[CoreOutput]:
        step = self.runner.execute(batch)
        if may_fly and not step.prompt and len(step.seqs) == len(batch) \
                and all(async_scheduling.flies(seq) for seq in batch.seqs):
            with self.phases("sample"):  # read by the next step, after it launches its own
                self.in_flight = async_scheduling.launch(batch, step, self.sampler.on_device(step))
            return []
        for part in step.prompt:
            self.sampler.record_prompt_logprobs(part)
        drafts = {seq.request_id: d for seq, d in zip(batch.seqs, batch.draft_token_ids) if d}
        with self.phases("sample"):
            tokens, logprobs = self.sampler(step, drafts) if step.seqs else ([], [])
        with self.phases("output"):
            return self._commit(batch, step, drafts, tokens, logprobs)

    def _commit(self, batch: ScheduledBatch, step: StepLogits, drafts: dict[str, list[int]], tokens: list[int],
                logprobs: list) -> list[CoreOutput]:
        """Append what was sampled: accepted drafts and stops; fail rows without a valid distribution."""
        outputs, emitted = [], []
        some_row_failed = min(tokens, default=0) < 0  # INVALID_TOKEN and NO_ALLOWED_TOKEN: look for whose
        end = 0
        for seq, rows in zip(step.seqs, step.rows):
            start, end = end, end + rows
            if seq.is_finished:  # aborted while its step ran, or (async scheduling) ended by the step before
                continue
            seq_drafts = drafts.get(seq.request_id) if drafts else None
            kept = start + 1 + (accepted_length(seq_drafts, tokens[start:end]) if seq_drafts else 0)
            if some_row_failed and (failure := self._failed_row(seq, tokens[start:kept])) is not None:
                outputs.append(failure)  # failed before its blocks publish
            else:
                emitted.append((seq, start, kept, seq_drafts))
        self.counters["prompt_tokens"] += self._num_prompt_tokens_in(batch)
        self.scheduler.mark_computed(batch)
        now = time.monotonic()  # the step's tokens all arrive now
        if step.pooled_seqs:
            outputs += self._finish_pooled(step, now)
        for seq, start, kept, seq_drafts in emitted:
            outputs.append(self._append_tokens(seq, tokens, logprobs, start, kept, now))
            if seq_drafts:
                self.speculator.verified(seq, seq_drafts, kept - start - 1)
                self.scheduler.release_rejected(seq)
        return outputs

    def _failed_row(self, seq: Sequence, tokens: list[int]) -> CoreOutput | None:
        """The failure of a row the sampler could not draw from, or None."""
        if INVALID_TOKEN in tokens:
            return self._fail(seq, "the model's output for this request was not a valid distribution (NaN or inf)")
        if NO_ALLOWED_TOKEN in tokens:
            return self._fail(seq, *no_allowed_token(seq))
        return None

    def _finish_pooled(self, step: StepLogits, now: float) -> list[CoreOutput]:
        """Embedding requests whose prompt the step computed end here, with their embedding."""
        outputs = []
        for seq, embedding in zip(step.pooled_seqs, embeddings(step.pooled, [seq.pooling for seq in step.pooled_seqs])):
            if seq.is_finished:  # aborted while its step ran
                continue
            seq.runtime.embedding = embedding
            seq.metrics.first_token_time = seq.metrics.last_token_time = now
            self.scheduler.finish(seq, "stop")
            outputs.append(core_output(seq))
        return outputs

    def _append_tokens(self, seq: Sequence, tokens: list[int], logprobs: list, start: int, end: int,
                       now: float) -> CoreOutput:
        """Append the step's tokens [start, end) (more than one where drafts were accepted) until one finishes the
        sequence. Indexes, not slices zipped: at batch 256 the slices, zip and enumerate were ~0.1 ms a step."""
        for i in range(start, end):
            if i > start:
                self.scheduler.accept_draft(seq)  # the draft fed at the previous token's position was this token
            self.counters["generation_tokens"] += 1
            try:
                self._append_token(seq, tokens[i], logprobs[i], now)
            except EngineInputError as exc:  # the request's own constraint failed it: a warning, not a traceback
                log.warning("request %s failed: %s", seq.request_id, exc)
                if seq.params.structured_output is not None:
                    self.grammars.forget(seq.params.structured_output)
                return self._fail(seq, str(exc), exc.param)
            except Exception as exc:
                log.exception("post-processing of request %s failed", seq.request_id)
                return self._fail(seq, f"post-processing failed: {type(exc).__name__}")
            if seq.is_finished:
                break
        return core_output(seq)

    def _draft_room(self, seq: Sequence) -> int:
        """How many drafts `seq` may verify next step: none while a row's rule depends on the tokens before it in
        the same step (penalties, a grammar, min_tokens, bad words), never so many that a thinking budget would force
        a token within the step, and never past max_tokens or the context."""
        params, state = seq.params, seq.runtime
        if (seq.pooling is not None or seq.num_uncomputed_tokens != 1 or params.has_penalties
                or state.grammar is not None or state.pending_grammar is not None
                or seq.num_output_tokens < params.min_tokens or params.bad_words_token_ids):
            return 0
        room = min(state.max_tokens - seq.num_output_tokens, self.max_model_len - len(seq)) - 1
        return room if state.thinking is None else max(0, min(room, state.thinking.free_tokens() - 1))

    @staticmethod
    def _num_prompt_tokens_in(batch: ScheduledBatch) -> int:
        return sum(min(seq.num_computed_tokens + n, seq.num_prompt_tokens) - seq.num_computed_tokens
                   for seq, n in zip(batch.seqs, batch.num_new_tokens) if seq.num_computed_tokens < seq.num_prompt_tokens)

    def _fail(self, seq: Sequence, message: str, param: str | None = None) -> CoreOutput:
        seq.runtime.error, seq.runtime.error_param = message, param
        self.scheduler.finish(seq, "abort")
        return core_output(seq)

    def _append_token(self, seq: Sequence, token: int, logprob: dict[int, float] | None, now: float) -> None:
        reason = self.stops.append(seq, token, logprob)
        timing = seq.metrics
        if self.metrics is not None:
            self.metrics.token(timing.arrival_time, timing.first_scheduled_time, timing.last_token_time, now,
                               seq.lora_name)
        timing.first_token_time = timing.first_token_time or now
        timing.last_token_time = now
        if reason is not None:
            self.scheduler.finish(seq, reason)

    def attach_metrics(self, metrics: StepMetrics) -> None:
        """Report from now on; counters start from the current totals. Call before the step loop starts."""
        metrics.start_from(self.stats())
        metrics.cache_config = {"kv_cache_dtype": str(self.runner.kv_dtype).removeprefix("torch."),
                                "block_size": str(self.block_manager.block_size)}
        self.metrics = metrics

    @property
    def metrics_share_of_step(self) -> float:
        """Time spent flushing metrics, as a share of the time spent in step(); 0 before any metered step."""
        if self.metrics is None or not self.step_seconds:
            return 0.0
        return self.metrics.update_seconds / self.step_seconds

    # -- introspection --------------------------------------------------------------------------------

    def settings(self) -> dict[str, str | int | bool]:
        """What the running engine actually uses, read from its live parts rather than its config: a knob that was
        set but never applied shows here."""
        linear = next(m for m in self.model.modules() if type(m).__name__ in ("Linear", "Linear4bit", "Linear8bitLt"))
        return {
            "dtype": str(self.dtype).removeprefix("torch."),
            "model_impl": self.model.impl,
            "linear_type": type(linear).__name__,
            "packed_weights": getattr(linear, "packed", None) is not None,
            "block_weights": getattr(linear, "blocks", None) is not None,  # GGUF blocks for small batches
            "num_kv_blocks": self.runner.num_blocks,
            "kv_cache_dtype": str(self.runner.kv_dtype).removeprefix("torch."),
            "block_size": self.block_manager.block_size,
            "enable_prefix_caching": self.block_manager.enable_prefix_caching,
            "max_num_seqs": self.scheduler.max_num_seqs,
            "max_num_batched_tokens": self.scheduler.max_num_batched_tokens,
            "long_prefill_token_threshold": self.scheduler.long_prefill_token_threshold,
            "max_model_len": self.max_model_len,
            "decode_kernel": self.runner.decode_kernel is not None,
            "prefill_kernel": getattr(self.runner.prefill_kernel, "__name__", ""),  # paged_prefill(_amx)_batch; "": SDPA
            "attention_backend": self.attention_backend,
            "cuda_graphs": self.runner.graphs.buckets if self.runner.graphs is not None and self.runner.graphs.graphs else None,
            "async_scheduling": self.async_scheduling,
            "device": self.device.type,
            "lora_adapters": ",".join(self.loras.adapters) if self.loras is not None else "",
        }

    def stats(self) -> EngineStats:
        bm = self.block_manager
        return EngineStats(
            num_running=len(self.scheduler.running), num_waiting=self.inbox.num_waiting,
            kv_blocks_total=bm.num_blocks, kv_blocks_free=bm.num_free_blocks,
            prefix_cache_queries=bm.prefix_cache_queries, prefix_cache_hits=bm.prefix_cache_hits,
            prefix_cache_evictions=bm.prefix_cache_evictions, num_preemptions=self.scheduler.num_preemptions,
            lora_loads=self.loras.num_loads if self.loras is not None else 0,
            consecutive_failed_steps=self.consecutive_failed_steps, metrics_share_of_step=self.metrics_share_of_step,
            **self.counters, **(self.speculator.counters if self.speculator is not None else {}),
            **stats_of(self.phases, self.gc_pauses, self.resident_memory))


def no_allowed_token(seq: Sequence) -> tuple[str, str]:
    """The message and field for a request whose own restrictions left no token to generate (a 400, not a 500)."""
    params, spec = seq.params, seq.params.structured_output
    fields = [name for name, on in (("allowed_token_ids", params.allowed_token_ids is not None),
                                    (spec.param if spec else None, spec is not None),
                                    ("bad_words", bool(params.bad_words)),
                                    ("min_tokens", seq.num_output_tokens < params.min_tokens)) if on]
    fields = fields or ["allowed_token_ids"]
    return f"{' and '.join(fields)} leave no token to generate at output position {seq.num_output_tokens}", fields[0]
