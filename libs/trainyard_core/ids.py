"""Identifiers. Job ids sort by creation time, so etcd key order is submission order."""

from __future__ import annotations

import secrets
import time

from . import contract

_ALPHABET = "0123456789abcdefghjkmnpqrstvwxyz"  # Crockford base32, lower case


def _b32(value: int, width: int) -> str:
    out = []
    for _ in range(width):
        out.append(_ALPHABET[value & 31])
        value >>= 5
    return "".join(reversed(out))


def new_id(prefix: str, now: float | None = None) -> str:
    """`<prefix>-` + 10 chars of milliseconds + 8 random chars: time-ordered, collision-safe."""
    ms = int((time.time() if now is None else now) * 1000)
    return f"{prefix}-{_b32(ms, 10)}{_b32(secrets.randbits(40), 8)}"


def id_time(value: str) -> float | None:
    """When an id from `new_id` was minted (unix seconds, millisecond resolution); None for another string."""
    _, dash, rest = value.rpartition("-")
    if not dash or len(rest) != 18:
        return None
    ms = 0
    for ch in rest[:10]:
        digit = _ALPHABET.find(ch)
        if digit < 0:
            return None
        ms = ms * 32 + digit
    return ms / 1000


def is_valid_id(value: str) -> bool:
    """Ids used as etcd key parts (the contract's ID rule: lower-case letters, digits and dashes, 3-63)."""
    return contract.ID.matches(value)
