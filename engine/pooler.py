"""Embeddings from the final hidden states of embedding requests' last prompt tokens: cut to `dimensions`, scaled to
unit length where asked, as little-endian float32 bytes (what the API's base64 encoding sends as they are)."""
from __future__ import annotations

import torch

from engine.pooling_params import PoolingParams


def embeddings(hidden: torch.Tensor, params: list[PoolingParams]) -> list[bytes]:
    """One embedding per row of `hidden` [rows, hidden_size], row i by params[i]. One copy to the host for all."""
    out = []
    for row, p in zip(hidden.float().cpu(), params):
        if p.dimensions is not None:
            row = row[: p.dimensions]
        if p.normalize:
            row = torch.nn.functional.normalize(row, dim=0)
        out.append(row.numpy().astype("<f4", copy=False).tobytes())
    return out
