"""Whether this engine keys blocks with lookahead (L=1) or legacy (L=0) keys.

From 0.34 the core decides, asking the connector class (KvtagConnector.supports_lookahead_block_hashes),
and kvtag takes L from num_hash_lookahead_tokens, so the two agree by construction. vLLM 0.32/0.33 never
tell a connector; there kvtag decides from the same facts the core later used.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from . import compat
from .config import KvtagConfig


@dataclass(frozen=True, slots=True)
class LookaheadDecision:
    tokens: int
    reason: str


def decide(vllm_config: Any, config: KvtagConfig, siblings: list[dict[str, Any]] | None) -> LookaheadDecision:
    """The core's L where it decides (0.34+); before, L=1 only for the EAGLE-family block drop with a
    one-token prefill lookahead, unless disabled. `siblings` are the MultiConnector child configs when
    kvtag is one of them."""
    if compat.core_decides_lookahead():
        tokens = compat.core_lookahead_tokens(vllm_config)
        if tokens:
            return LookaheadDecision(
                tokens, f"vLLM hashes with lookahead {tokens} (num_hash_lookahead_tokens)"
            )
        why = _legacy_reason(vllm_config, config, siblings)
        return LookaheadDecision(0, f"vLLM hashes without lookahead ({why or 'num_hash_lookahead_tokens=0'})")
    why = _legacy_reason(vllm_config, config, siblings)
    if why:
        return LookaheadDecision(0, why)
    return LookaheadDecision(1, "EAGLE-family block drop with one prefill lookahead token")


def wanted(config: KvtagConfig) -> bool:
    """KvtagConnector's answer to the core's opt-in question (0.34+): everything but `lookahead: off`."""
    return config.lookahead != "off"


def _legacy_reason(vllm_config: Any, config: KvtagConfig, siblings: list[dict[str, Any]] | None) -> str:
    """Why this engine keys with L=0, or "" when nothing stands against lookahead."""
    if config.lookahead == "off":
        return "lookahead disabled by kv_connector_extra_config['lookahead']='off'"
    if not compat.eagle_block_drop(vllm_config):
        return "no EAGLE-family block drop: legacy keys lose nothing"
    if compat.prefill_lookahead_tokens(vllm_config) != 1:
        return f"num_prefill_lookahead_tokens={compat.prefill_lookahead_tokens(vllm_config)} (need 1)"
    if compat.core_lookahead_disabled(vllm_config):
        return "disable_lookahead_block_hashes is set in vLLM"
    if siblings is not None and not all(compat.connector_supports_lookahead(c) for c in siblings):
        return "a MultiConnector sibling does not support lookahead block hashes"
    return ""
