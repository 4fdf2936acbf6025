"""Route kvtag's log records through vLLM's handler.

vLLM configures a handler on its own "vllm" logger only, so records of the "kvtag" and
"kvtag_client" loggers below WARNING (the lookahead decision, the session state) would reach no
handler and vanish from `vllm serve` output.
"""

from __future__ import annotations

import logging

KVTAG_LOGGERS = ("kvtag", "kvtag_client")


def route_through_vllm() -> None:
    """Give kvtag's loggers vLLM's handlers and level, unless the application configured them."""
    vllm_logger = logging.getLogger("vllm")
    if not vllm_logger.handlers:
        return
    for name in KVTAG_LOGGERS:
        logger = logging.getLogger(name)
        if logger.handlers:
            continue
        for handler in vllm_logger.handlers:
            logger.addHandler(handler)
        logger.setLevel(vllm_logger.getEffectiveLevel())
        logger.propagate = False
