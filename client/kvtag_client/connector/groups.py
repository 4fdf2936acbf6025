"""Which KV cache groups hold per-token KV (attention) and which hold a per-request state (Mamba)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True, slots=True)
class CacheGroups:
    kv_groups: tuple[int, ...]
    state_groups: tuple[int, ...]

    @property
    def hybrid(self) -> bool:
        return bool(self.state_groups)


def classify(kv_cache_config: Any) -> CacheGroups:
    from vllm.v1.kv_cache_interface import MambaSpec

    kv: list[int] = []
    state: list[int] = []
    for index, group in enumerate(kv_cache_config.kv_cache_groups):
        (state if isinstance(group.kv_cache_spec, MambaSpec) else kv).append(index)
    return CacheGroups(kv_groups=tuple(kv), state_groups=tuple(state))
