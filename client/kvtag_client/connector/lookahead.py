"""Whether this engine keys blocks with lookahead (L=1) or legacy (L=0) keys.

vLLM 0.32/0.33 never tell a connector; kvtag decides from the same facts a future core would use.
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


def decide(
    vllm_config: Any, config: KvtagConfig, requested: bool | None, siblings: list[dict[str, Any]] | None
) -> LookaheadDecision:
    """L=1 only for the EAGLE-family block drop with a one-token prefill lookahead, unless disabled.

    `requested` is what `set_lookahead_block_hashes` asked for (None if never called); `siblings`
    are the MultiConnector child configs when kvtag is one of them.
    """
    if config.lookahead == "off":
        return LookaheadDecision(0, "lookahead disabled by kv_connector_extra_config['lookahead']='off'")
    if requested is False:
        return LookaheadDecision(0, "lookahead disabled by set_lookahead_block_hashes(False)")
    if not compat.eagle_block_drop(vllm_config):
        return LookaheadDecision(0, "no EAGLE-family block drop: legacy keys lose nothing")
    if compat.prefill_lookahead_tokens(vllm_config) != 1:
        return LookaheadDecision(
            0, f"num_prefill_lookahead_tokens={compat.prefill_lookahead_tokens(vllm_config)} (need 1)"
        )
    if compat.core_lookahead_disabled(vllm_config):
        return LookaheadDecision(0, "disable_lookahead_block_hashes is set in vLLM")
    if siblings is not None and not all(compat.connector_supports_lookahead(c) for c in siblings):
        return LookaheadDecision(0, "a MultiConnector sibling does not support lookahead block hashes")
    return LookaheadDecision(1, "EAGLE-family block drop with one prefill lookahead token")
