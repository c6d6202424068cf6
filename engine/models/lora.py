"""LoRA adapters in PEFT's format (adapter_config.json, adapter_model.safetensors), read and stacked onto the native
model's linears (engine/lora_manager.py decides when); merged projections (q/k/v, gate/up) get one
adapter pair whose up-projection is block-diagonal over their shards. What the engine cannot apply exactly is refused
with the setting that asks for it."""
from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file

from engine.config import LoRAModule
from engine.layers.linear import Linear, MergedLinear
from engine.models.llama import MERGED

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
    pairs: dict[str, tuple[torch.Tensor, torch.Tensor]]  # the model's linear -> (down [in, r'], up [r', out])


def _read_checkpoint(module: LoRAModule, max_rank: int) -> tuple[int, dict[str, tuple[torch.Tensor, torch.Tensor]]]:
    """The adapter's rank, and its checkpoint module name -> (A [rank, in], scale * B [out, rank])."""
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
    return rank, weights


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


def prepare_adapter(model, module: LoRAModule, max_rank: int) -> LoRAAdapter:
    """Read an adapter and shape it for `model`: each linear's pair, merged as the model's projections are, on its
    device and in its dtype (a thread may do this beside the model's steps: it touches nothing they use)."""
    rank, weights = _read_checkpoint(module, max_rank)
    weight = model.model.embed_tokens.weight
    pairs = {}
    for path, shards in _by_linear(weights).items():
        linear = _linear(model, path, module.name)
        down, up = _merged_pair(linear, shards) if isinstance(linear, MergedLinear) else _own_pair(linear, shards[0])
        pairs[path] = (down.to(weight.device, weight.dtype), up.to(weight.device, weight.dtype))
    return LoRAAdapter(module.name, rank, pairs)


def _by_linear(weights: dict[str, tuple[torch.Tensor, torch.Tensor]]) -> dict[str, dict[int, tuple[torch.Tensor, torch.Tensor]]]:
    """The native model's linear path -> {shard: (A, B)} (shard 0 of a linear that is not merged)."""
    linears: dict[str, dict[int, tuple[torch.Tensor, torch.Tensor]]] = {}
    for name, pair in weights.items():
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
