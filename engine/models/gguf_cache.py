"""A GGUF file's tensors as `engine/models/gguf.py` reads them, kept once as safetensors. The gguf library's reader
parses every metadata field at each open (the embedded model's tokenizer is ~100,000 strings: 3-4 s of a replica's
start); the kept copy opens in a fraction of that. The key is the file's path, size and mtime, so a changed file is
read again."""
from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Iterator

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from engine.layers.quantized import BlockWeight
from engine.models.cache_files import write_whole

FORMAT = 1  # raise when what read_tensors yields changes
Tensors = list[tuple[str, "torch.Tensor | BlockWeight"]]


def kept_path(gguf: Path, cache: Path) -> Path:
    stat = gguf.stat()
    key = hashlib.sha256(f"{FORMAT}:{gguf.resolve()}:{stat.st_size}:{stat.st_mtime_ns}".encode()).hexdigest()[:16]
    return cache / "gguf-tensors" / f"{gguf.stem}-{key}.safetensors"


def keep(path: Path, tensors: Tensors) -> None:
    """Writes `tensors` to `path` (whole or not at all)."""
    flat, kinds = {}, {}
    for name, value in tensors:
        if isinstance(value, BlockWeight):
            kinds[name] = value.kind
            parts = {"codes": value.codes, "scales": value.scales, "mins": value.mins}
            flat.update({f"{name}:{part}": t.contiguous() for part, t in parts.items() if t is not None})
        else:
            kinds[name] = "dense"
            flat[name] = value.contiguous()
    metadata = {"order": json.dumps([name for name, _ in tensors]), "kinds": json.dumps(kinds)}
    write_whole(path, lambda staging: save_file(flat, str(staging), metadata=metadata))


def load_kept(path: Path) -> Iterator[tuple[str, torch.Tensor | BlockWeight]]:
    with safe_open(str(path), framework="pt") as kept:
        metadata = kept.metadata()
        kinds = json.loads(metadata["kinds"])
        for name in json.loads(metadata["order"]):
            kind = kinds[name]
            if kind == "dense":
                yield name, kept.get_tensor(name)
            else:
                mins = kept.get_tensor(f"{name}:mins") if kind == "q4" else None
                yield name, BlockWeight(kind, kept.get_tensor(f"{name}:codes"), kept.get_tensor(f"{name}:scales"), mins)
