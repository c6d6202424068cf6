"""LoRA adapters in PEFT's format (adapter_config.json, adapter_model.safetensors), read at start (lora_modules) or
on first use (lora_root) and attached to the native model's linears; merged projections (q/k/v, gate/up) get one
adapter pair whose up-projection is block-diagonal over their shards. What the engine cannot apply exactly is refused
with the setting that asks for it."""
from __future__ import annotations

import json
import logging
import math
import re
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file

from engine.config import EngineConfig, LoRAModule
from engine.errors import EngineInputError
from engine.layers.linear import Linear, MergedLinear
from engine.layers.lora import LinearLoRA, LoRAStep
from engine.models.llama import MERGED

log = logging.getLogger(__name__)

# PEFT's names: base_model.model.<the base model's module>.lora_A|lora_B[.adapter name].weight
KEY = re.compile(r"^base_model\.model\.(?P<module>.+)\.lora_(?P<half>[AB])(?:\.[\w-]+)?\.weight$")
TARGETS = {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}
# adapter_config.json settings that change the math away from y += scale * B A x, refused when set
UNSUPPORTED = {"use_dora": False, "fan_in_fan_out": False, "modules_to_save": None, "rank_pattern": {},
               "alpha_pattern": {}, "trainable_token_indices": None, "alora_invocation_tokens": None}


@dataclass
class LoRAAdapter:
    name: str
    rank: int
    weights: dict[str, tuple[torch.Tensor, torch.Tensor]]  # checkpoint module name -> (A [rank, in], scale * B [out, rank])


def read_adapter(module: LoRAModule, max_rank: int) -> LoRAAdapter:
    directory = Path(module.path)
    where = f"LoRA adapter {module.name!r} ({directory})"
    config_file, weights_file = directory / "adapter_config.json", directory / "adapter_model.safetensors"
    if not config_file.is_file() or not weights_file.is_file():
        raise ValueError(f"{where}: needs adapter_config.json and adapter_model.safetensors (PEFT's format)")
    config = json.loads(config_file.read_text())
    _check_settings(config, where, max_rank)
    rank, alpha = config["r"], config.get("lora_alpha", config["r"])
    scale = alpha / (math.sqrt(rank) if config.get("use_rslora") else rank)
    halves: dict[str, dict[str, torch.Tensor]] = {}
    for key, tensor in load_file(str(weights_file)).items():
        match = KEY.match(key)
        if match is None or match["module"].rpartition(".")[2] not in TARGETS:
            raise ValueError(f"{where}: {key} adapts something other than the decoder's linear layers, which is all "
                             f"the engine applies ({', '.join(sorted(TARGETS))})")
        halves.setdefault(match["module"], {})[match["half"]] = tensor.float()
    weights = {}
    for name, pair in halves.items():
        if set(pair) != {"A", "B"} or pair["A"].shape[0] != rank or pair["B"].shape[1] != rank:
            raise ValueError(f"{where}: {name} needs lora_A [{rank}, in] and lora_B [out, {rank}]")
        weights[name] = (pair["A"], pair["B"] * scale)
    return LoRAAdapter(module.name, rank, weights)


def _check_settings(config: dict, where: str, max_rank: int) -> None:
    if config.get("peft_type", "LORA") != "LORA":
        raise ValueError(f"{where}: peft_type is {config['peft_type']}; only LORA adapters are served")
    for setting, plain in UNSUPPORTED.items():
        if config.get(setting, plain) not in (plain, None, {}, [], False):
            raise ValueError(f"{where}: {setting} is set; the engine applies plain LoRA only")
    if config.get("bias", "none") != "none":
        raise ValueError(f"{where}: bias is {config['bias']!r}; the engine applies adapters without biases only")
    if not isinstance(config.get("r"), int) or not 0 < config["r"] <= max_rank:
        raise ValueError(f"{where}: rank r={config.get('r')} is outside [1, max_lora_rank={max_rank}]")


class LoRAManager:
    """The adapters on the model: lora_modules' for the engine's life, lora_root's loaded on first use and, past
    max_loras, dropped least recently used first once no request runs them. Every load and drop restacks the linears'
    adapters, between steps: on SmolLM2 at rank 16 a load held the step loop ~50 ms, a drop ~23 (BENCHMARKS.md). An adapter's `key` starts its prefix-cache chains: its name, and for one from
    lora_root the weights file's size and time, so blocks of an adapter since replaced on disk serve no one."""

    def __init__(self, model, config: EngineConfig):
        self.model, self.config = model, config
        self.step = LoRAStep([])
        model.lora_step = model.model.lora_step = self.step
        self.static = [module.name for module in config.lora_modules]
        self.adapters: OrderedDict[str, LoRAAdapter] = OrderedDict()  # least recently used first
        self.keys: dict[str, str] = {}
        for module in config.lora_modules:
            self.adapters[module.name], self.keys[module.name] = read_adapter(module, config.max_lora_rank), module.name
        self._restack()

    def ensure(self, name: str) -> str:
        """Load adapter `name` unless it is loaded; its prefix-cache key. EngineInputError where it cannot be."""
        if name not in self.adapters:
            self._load(name)
        self.adapters.move_to_end(name)
        return self.keys[name]

    def drop_idle(self, in_use: set[str]) -> list[str]:
        """Drop loaded lora_root adapters past max_loras, least recently used first, that no request runs."""
        dynamic = [name for name in self.adapters if name not in self.static]
        excess = len(dynamic) - self.config.max_loras
        dropped = [name for name in dynamic if name not in in_use][: max(0, excess)]
        for name in dropped:
            del self.adapters[name], self.keys[name]
        if dropped:
            self._restack()
        return dropped

    def _load(self, name: str) -> None:
        path = self.config.lora_path(name)
        if path is None:
            raise EngineInputError(f"LoRA adapter {name[:256]!r} is not served here", "lora_name")
        try:
            self.adapters[name] = read_adapter(LoRAModule(name=name, path=path), self.config.max_lora_rank)
            self.keys[name] = f"{name}@{_file_identity(Path(path) / 'adapter_model.safetensors')}"
            self._restack()
        except Exception as exc:  # a broken adapter fails its requests, never the engine
            self.adapters.pop(name, None)
            self.keys.pop(name, None)
            self._restack()
            raise EngineInputError(f"LoRA adapter {name!r} could not be loaded: {exc}", "lora_name") from exc
        log.info("loaded LoRA adapter %s (rank %d)", name, self.adapters[name].rank)

    def _restack(self) -> None:
        _attach(self.model, list(self.adapters.values()), self.step)


def _file_identity(path: Path) -> str:
    stat = path.stat()
    return f"{stat.st_size}-{stat.st_mtime_ns}"


def _attach(model, adapters: list[LoRAAdapter], step: LoRAStep) -> None:
    """Give every linear an adapter touches its LinearLoRA (and every other none); adapter i is index i of `step`."""
    pairs: dict[str, dict[int, tuple[torch.Tensor, torch.Tensor]]] = {}  # linear path -> adapter index -> (down, up)
    for index, adapter in enumerate(adapters):
        for path, shards in _by_linear(adapter).items():
            linear = _linear(model, path, adapter.name)
            pair = _merged_pair(linear, shards) if isinstance(linear, MergedLinear) else _own_pair(linear, shards[0])
            pairs.setdefault(path, {})[index] = pair
    weight = model.model.embed_tokens.weight
    for name, linear in model.model.layers.named_modules(prefix="model.layers"):
        if isinstance(linear, Linear):
            by_adapter = pairs.get(name)
            linear.lora = None if by_adapter is None else LinearLoRA(
                step, by_adapter, len(adapters), linear.in_features, linear.out_features, weight)
    step.index = {adapter.name: i for i, adapter in enumerate(adapters)}


def _by_linear(adapter: LoRAAdapter) -> dict[str, dict[int, tuple[torch.Tensor, torch.Tensor]]]:
    """The native model's linear path -> {shard: (A, B)} (shard 0 of a linear that is not merged)."""
    linears: dict[str, dict[int, tuple[torch.Tensor, torch.Tensor]]] = {}
    for name, pair in adapter.weights.items():
        parent, _, leaf = name.rpartition(".")
        merged, shard = MERGED.get(leaf, (leaf, 0))
        linears.setdefault(f"{parent}.{merged}", {})[shard] = pair
    return linears


def _linear(model, path: str, adapter: str) -> Linear:
    try:
        linear = model.get_submodule(path)
    except AttributeError:
        linear = None
    if not isinstance(linear, Linear):
        raise ValueError(f"LoRA adapter {adapter!r} adapts {path}, which this model does not have")
    return linear


def _own_pair(linear: Linear, pair: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    a, b = pair
    _check_shape(linear, a.shape[1], b.shape[0], linear.out_features)
    return a.t().contiguous(), b.t().contiguous()


def _merged_pair(linear: MergedLinear, shards: dict[int, tuple[torch.Tensor, torch.Tensor]]) -> tuple[torch.Tensor, torch.Tensor]:
    """The shards' A stacked, and B placed block-diagonally: one adapter pair for the merged projection."""
    starts = [sum(linear.output_sizes[:i]) for i in range(len(linear.output_sizes))]
    down = torch.cat([shards[s][0] for s in sorted(shards)]).t().contiguous()
    up = torch.zeros(down.shape[1], linear.out_features)
    row = 0
    for shard in sorted(shards):
        a, b = shards[shard]
        _check_shape(linear, a.shape[1], b.shape[0], linear.output_sizes[shard])
        up[row : row + a.shape[0], starts[shard] : starts[shard] + b.shape[0]] = b.t()
        row += a.shape[0]
    return down, up


def _check_shape(linear: Linear, in_features: int, out_features: int, expected_out: int) -> None:
    if (in_features, out_features) != (linear.in_features, expected_out):
        raise ValueError(f"a LoRA adapter maps {in_features} -> {out_features} features where the model's linear maps "
                         f"{linear.in_features} -> {expected_out}: it was trained for another base model")
