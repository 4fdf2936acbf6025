"""The tensor-parallel suite's fault: one worker rank talks to another store than the rest.

`kv_connector_extra_config["rank1_endpoint"]` points TP rank 1's worker at a second kvtag-store,
while the scheduler and rank 0 use `endpoint`. The first store then really lacks rank 1's blocks
(the store has no delete call, so this is how a test makes one rank's blocks go missing): an engine
that saves this way leaves them elsewhere, and an engine that loads this way finds them missing
after the scheduler reported the hit. vLLM imports this module in its worker processes by
`kv_connector_module_path`.
"""

from __future__ import annotations

from typing import Any

from kvtag_client.connector import KvtagConnector
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole


class SplitStoreConnector(KvtagConnector):
    def __init__(self, vllm_config: Any, role: KVConnectorRole, kv_cache_config: Any) -> None:
        transfer = vllm_config.kv_transfer_config
        extra = dict(transfer.kv_connector_extra_config)
        elsewhere = extra.get("rank1_endpoint")
        if role == KVConnectorRole.WORKER and elsewhere:
            from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

            if get_tensor_model_parallel_rank() == 1:
                # This worker process's own copy of the config: the scheduler and rank 0 keep theirs.
                transfer.kv_connector_extra_config = {**extra, "endpoint": elsewhere}
        super().__init__(vllm_config, role, kv_cache_config)
