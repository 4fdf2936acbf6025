"""Put results the API layer answers itself, without asking the backend."""

from __future__ import annotations

from kvtag_store.backends.base import PutOutcome, PutResult

SHM_REFUSED = PutResult(
    PutOutcome.REJECTED,
    "data path not negotiated: this session uses DATA_PATH_INLINE (attach the shared-memory arena "
    "with AttachSharedMemory first); send the bytes in `value`",
)
SHM_IN_PUT = PutResult(
    PutOutcome.REJECTED,
    "shared-memory values are not committed by Put: reserve slots (ReserveSlots), write them and "
    "commit them (CommitSlots), or send the bytes in `value`",
)
NO_PAYLOAD = PutResult(PutOutcome.REJECTED, "item carries no payload; set `value`")
SESSION_ENDED = PutResult(
    PutOutcome.REJECTED, "the session ended while its slots were being reserved; open a new session"
)
# Outcomes after which the block is stored in the caller's mode (base keys are recorded for them);
# they carry no reason.
SETTLED = (PutOutcome.STORED, PutOutcome.ALREADY_PRESENT)


class ValueLimit:
    """The largest value one item may carry, on either data path, and the refusal of a larger one."""

    def __init__(self, max_value_bytes: int) -> None:
        self.max_value_bytes = max_value_bytes

    def too_large(self, size: int) -> PutResult:
        return PutResult(
            PutOutcome.REJECTED,
            f"value of {size} bytes exceeds Limits.max_value_bytes of {self.max_value_bytes} bytes (the "
            "smallest of the store capacity, the backend's value limit and --max-message-bytes less "
            "headroom); store smaller blocks",
        )
