"""vLLM's ``rotary_embedding`` custom op in plain torch (the one function SGLang's CPU path calls)."""

from __future__ import annotations

import torch


def rotary_embedding(positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor | None, head_size: int,
                     cos_sin_cache: torch.Tensor, is_neox: bool) -> None:
    """In place, vLLM's signature. ``cos_sin_cache`` is ``[max_position, rot_dim]`` = ``[cos | sin]``."""
    positions = positions.flatten()
    n = positions.shape[0]
    cos, sin = cos_sin_cache.index_select(0, positions).chunk(2, dim=-1)
    rot_dim = cos.shape[-1] * 2
    for x in (query, key):
        if x is None:
            continue
        rot = x.view(n, -1, head_size)[..., :rot_dim]
        c, s = cos.unsqueeze(1).to(rot.dtype), sin.unsqueeze(1).to(rot.dtype)
        if is_neox:
            x1, x2 = rot[..., : rot_dim // 2], rot[..., rot_dim // 2 :]
            rot.copy_(torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1))
        else:
            x1, x2 = rot[..., 0::2], rot[..., 1::2]
            rot.copy_(torch.stack((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1).flatten(-2))
