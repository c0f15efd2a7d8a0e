"""The binding of transferred KV to its prompt: a digest of the prompt's token ids (importable without vLLM).

The prefill computes it over the tokens it computed the KV for and sends it inside DONE (kvxfer's
verified completion, on the connection the decode opened to that prefill), so a client cannot forge it:
``kv_transfer_params`` only name the request. The decode computes the digest over the tokens it was
asked to decode and accepts the load only if both are equal, after coverage, byte counts and the
checksum verified. Invariant: equal digests mean equal token sequences (BLAKE2b-256 over the count and
the ids as little-endian 64-bit integers, under a domain prefix that names the format).
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import numpy as np

_DOMAIN = b"kvxfer/vllm/prompt-binding/v1\0"
DIGEST_BYTES = 32


def prompt_binding(token_ids: Sequence[int]) -> bytes:
    """The binding of a prompt: 32 bytes that only the same token ids give."""
    ids = np.asarray(list(token_ids), dtype="<i8")
    h = hashlib.blake2b(_DOMAIN, digest_size=DIGEST_BYTES)
    h.update(len(ids).to_bytes(8, "little"))
    h.update(ids.tobytes())
    return h.digest()
