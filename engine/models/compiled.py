"""The native model's forward compiled by `torch.compile` (inductor), for every step the one-call native decode
does not take: one graph over the embedding, all layers and the LM head, with paged attention as a custom op
(`engine/layers/attention_op.py`), so the norms, rotary and SiLU-and-mul fuse into the code around the matmuls.

Shapes are symbolic, and every size a step varies is unbacked (never specialised, not even for 0 or 1), so one
graph serves every batch after the first compile. Inductor's caches live under the engine's cache directory: a
second start reuses them.
"""
from __future__ import annotations

import logging
import os
import time
from pathlib import Path

import torch
from torch._inductor.compile_fx import compile_fx
from torch._inductor.runtime.cache_dir_utils import default_cache_dir

from engine.layers.attention import AttentionMetadata
from engine.layers.attention_op import AttentionTensors

log = logging.getLogger(__name__)


class CompiledForward:
    def __init__(self, model, cache_dir: Path):
        if os.environ.get("TORCHINDUCTOR_CACHE_DIR") in (None, default_cache_dir()):  # unless the operator chose one
            os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(cache_dir / "inductor")  # read by inductor at each compile
        self.model = model
        self.graph = torch.compile(self._forward, backend=self._inductor, dynamic=True, fullgraph=True)
        self.graphs = 0  # graphs compiled: more than one means a guard failed and dynamo recompiled
        self.steps = 0

    def _inductor(self, graph_module, example_inputs):
        self.graphs += 1
        return compile_fx(graph_module, example_inputs)

    def _forward(self, input_ids, positions, attention: AttentionTensors, logits_indices) -> torch.Tensor:
        decoder = self.model.model
        hidden = decoder.layers_forward(decoder.embed_tokens(input_ids), positions, attention)
        return self.model.lm_head(hidden, logits_indices)

    def __call__(self, input_ids, positions, meta: AttentionMetadata, logits_indices) -> torch.Tensor:
        attention = AttentionTensors.of(meta)
        for tensor in (attention.decode_tables, attention.prefill_tables):
            torch._dynamo.decorators.mark_unbacked(tensor, 0)
            torch._dynamo.decorators.mark_unbacked(tensor, 1)
        for tensor in (input_ids, positions, logits_indices, attention.slot_mapping, attention.decode_lens,
                       attention.prefill_spans):
            torch._dynamo.decorators.mark_unbacked(tensor, 0)
        graphs, start = self.graphs, time.perf_counter()
        with compile_options():
            logits = self.graph(input_ids, positions, attention, logits_indices)
        self.steps += 1
        if self.graphs > graphs:
            log.info("compiled the decoder (graph %d) in %.1f s; inductor's cache: %s", self.graphs,
                     time.perf_counter() - start, os.environ["TORCHINDUCTOR_CACHE_DIR"])
        return logits


def compile_options():
    """Floats (scaling, eps) stay constants: as symbols, dynamo would trace twice, restarting to specialise them.
    Not used, as measured: inductor's C++ wrapper (no faster a step here, twice the cold compile) and freezing
    (inductor packs the frozen weights itself, but keeps a second copy of them and cannot cache such a graph)."""
    return torch._dynamo.config.patch(specialize_float=True)
