from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class ErrorReason(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    ERROR_REASON_UNSPECIFIED: _ClassVar[ErrorReason]
    SESSION_NOT_FOUND: _ClassVar[ErrorReason]
    INVALID_DESCRIPTOR: _ClassVar[ErrorReason]
    EMPTY_KEY: _ClassVar[ErrorReason]
    KEY_TOO_LARGE: _ClassVar[ErrorReason]
    BATCH_TOO_LARGE: _ClassVar[ErrorReason]
    MODE_REFUSED: _ClassVar[ErrorReason]
    PROBE_DISAGREEMENT: _ClassVar[ErrorReason]
    INVALID_PROBE: _ClassVar[ErrorReason]
    BACKEND_UNAVAILABLE: _ClassVar[ErrorReason]
    INVALID_REQUEST: _ClassVar[ErrorReason]
    UNAUTHENTICATED: _ClassVar[ErrorReason]
    TENANT_NOT_GRANTED: _ClassVar[ErrorReason]
    ROLE_NOT_ALLOWED: _ClassVar[ErrorReason]
    MALFORMED_REQUEST: _ClassVar[ErrorReason]
    SERVER_BUSY: _ClassVar[ErrorReason]
    DATA_PATH_NOT_NEGOTIATED: _ClassVar[ErrorReason]
    NAMESPACE_CAP_REACHED: _ClassVar[ErrorReason]
    SESSION_CAP_REACHED: _ClassVar[ErrorReason]

class Policy(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    POLICY_UNSPECIFIED: _ClassVar[Policy]
    POLICY_ISOLATE: _ClassVar[Policy]
    POLICY_STRICT: _ClassVar[Policy]

class DataPath(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    DATA_PATH_UNSPECIFIED: _ClassVar[DataPath]
    DATA_PATH_INLINE: _ClassVar[DataPath]
    DATA_PATH_SHARED_MEMORY: _ClassVar[DataPath]

class KeyStatus(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    KEY_STATUS_UNSPECIFIED: _ClassVar[KeyStatus]
    HIT: _ClassVar[KeyStatus]
    MISS: _ClassVar[KeyStatus]
    MODE_MISMATCH: _ClassVar[KeyStatus]

class PutStatus(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    PUT_STATUS_UNSPECIFIED: _ClassVar[PutStatus]
    STORED: _ClassVar[PutStatus]
    ALREADY_PRESENT: _ClassVar[PutStatus]
    CONFLICT: _ClassVar[PutStatus]
    REJECTED: _ClassVar[PutStatus]
ERROR_REASON_UNSPECIFIED: ErrorReason
SESSION_NOT_FOUND: ErrorReason
INVALID_DESCRIPTOR: ErrorReason
EMPTY_KEY: ErrorReason
KEY_TOO_LARGE: ErrorReason
BATCH_TOO_LARGE: ErrorReason
MODE_REFUSED: ErrorReason
PROBE_DISAGREEMENT: ErrorReason
INVALID_PROBE: ErrorReason
BACKEND_UNAVAILABLE: ErrorReason
INVALID_REQUEST: ErrorReason
UNAUTHENTICATED: ErrorReason
TENANT_NOT_GRANTED: ErrorReason
ROLE_NOT_ALLOWED: ErrorReason
MALFORMED_REQUEST: ErrorReason
SERVER_BUSY: ErrorReason
DATA_PATH_NOT_NEGOTIATED: ErrorReason
NAMESPACE_CAP_REACHED: ErrorReason
SESSION_CAP_REACHED: ErrorReason
POLICY_UNSPECIFIED: Policy
POLICY_ISOLATE: Policy
POLICY_STRICT: Policy
DATA_PATH_UNSPECIFIED: DataPath
DATA_PATH_INLINE: DataPath
DATA_PATH_SHARED_MEMORY: DataPath
KEY_STATUS_UNSPECIFIED: KeyStatus
HIT: KeyStatus
MISS: KeyStatus
MODE_MISMATCH: KeyStatus
PUT_STATUS_UNSPECIFIED: PutStatus
STORED: PutStatus
ALREADY_PRESENT: PutStatus
CONFLICT: PutStatus
REJECTED: PutStatus

class NamespaceDescriptor(_message.Message):
    __slots__ = ("model_name", "weights_fingerprint", "kv_dtype", "kv_layout", "block_size", "parallel_sharding", "tenant")
    MODEL_NAME_FIELD_NUMBER: _ClassVar[int]
    WEIGHTS_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    KV_DTYPE_FIELD_NUMBER: _ClassVar[int]
    KV_LAYOUT_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    PARALLEL_SHARDING_FIELD_NUMBER: _ClassVar[int]
    TENANT_FIELD_NUMBER: _ClassVar[int]
    model_name: str
    weights_fingerprint: str
    kv_dtype: str
    kv_layout: str
    block_size: int
    parallel_sharding: str
    tenant: str
    def __init__(self, model_name: _Optional[str] = ..., weights_fingerprint: _Optional[str] = ..., kv_dtype: _Optional[str] = ..., kv_layout: _Optional[str] = ..., block_size: _Optional[int] = ..., parallel_sharding: _Optional[str] = ..., tenant: _Optional[str] = ...) -> None: ...

class HashingMode(_message.Message):
    __slots__ = ("key_scheme", "scheme_version", "hash_algorithm", "hash_block_size", "lookahead_tokens", "seed_fingerprint")
    KEY_SCHEME_FIELD_NUMBER: _ClassVar[int]
    SCHEME_VERSION_FIELD_NUMBER: _ClassVar[int]
    HASH_ALGORITHM_FIELD_NUMBER: _ClassVar[int]
    HASH_BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    LOOKAHEAD_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SEED_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    key_scheme: str
    scheme_version: str
    hash_algorithm: str
    hash_block_size: int
    lookahead_tokens: int
    seed_fingerprint: str
    def __init__(self, key_scheme: _Optional[str] = ..., scheme_version: _Optional[str] = ..., hash_algorithm: _Optional[str] = ..., hash_block_size: _Optional[int] = ..., lookahead_tokens: _Optional[int] = ..., seed_fingerprint: _Optional[str] = ...) -> None: ...

class SharedMemoryRef(_message.Message):
    __slots__ = ("segment", "offset", "length", "generation")
    SEGMENT_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    LENGTH_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    segment: str
    offset: int
    length: int
    generation: int
    def __init__(self, segment: _Optional[str] = ..., offset: _Optional[int] = ..., length: _Optional[int] = ..., generation: _Optional[int] = ...) -> None: ...

class SharedMemoryOffer(_message.Message):
    __slots__ = ("segment", "path", "size_bytes", "nonce_offset", "nonce_length")
    SEGMENT_FIELD_NUMBER: _ClassVar[int]
    PATH_FIELD_NUMBER: _ClassVar[int]
    SIZE_BYTES_FIELD_NUMBER: _ClassVar[int]
    NONCE_OFFSET_FIELD_NUMBER: _ClassVar[int]
    NONCE_LENGTH_FIELD_NUMBER: _ClassVar[int]
    segment: str
    path: str
    size_bytes: int
    nonce_offset: int
    nonce_length: int
    def __init__(self, segment: _Optional[str] = ..., path: _Optional[str] = ..., size_bytes: _Optional[int] = ..., nonce_offset: _Optional[int] = ..., nonce_length: _Optional[int] = ...) -> None: ...

class Limits(_message.Message):
    __slots__ = ("max_key_bytes", "max_batch_items", "max_value_bytes", "max_message_bytes")
    MAX_KEY_BYTES_FIELD_NUMBER: _ClassVar[int]
    MAX_BATCH_ITEMS_FIELD_NUMBER: _ClassVar[int]
    MAX_VALUE_BYTES_FIELD_NUMBER: _ClassVar[int]
    MAX_MESSAGE_BYTES_FIELD_NUMBER: _ClassVar[int]
    max_key_bytes: int
    max_batch_items: int
    max_value_bytes: int
    max_message_bytes: int
    def __init__(self, max_key_bytes: _Optional[int] = ..., max_batch_items: _Optional[int] = ..., max_value_bytes: _Optional[int] = ..., max_message_bytes: _Optional[int] = ...) -> None: ...

class OpenSessionRequest(_message.Message):
    __slots__ = ("engine_id", "namespace", "mode", "probe_keys", "data_paths", "labels")
    class LabelsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    ENGINE_ID_FIELD_NUMBER: _ClassVar[int]
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    MODE_FIELD_NUMBER: _ClassVar[int]
    PROBE_KEYS_FIELD_NUMBER: _ClassVar[int]
    DATA_PATHS_FIELD_NUMBER: _ClassVar[int]
    LABELS_FIELD_NUMBER: _ClassVar[int]
    engine_id: str
    namespace: NamespaceDescriptor
    mode: HashingMode
    probe_keys: _containers.RepeatedScalarFieldContainer[bytes]
    data_paths: _containers.RepeatedScalarFieldContainer[DataPath]
    labels: _containers.ScalarMap[str, str]
    def __init__(self, engine_id: _Optional[str] = ..., namespace: _Optional[_Union[NamespaceDescriptor, _Mapping]] = ..., mode: _Optional[_Union[HashingMode, _Mapping]] = ..., probe_keys: _Optional[_Iterable[bytes]] = ..., data_paths: _Optional[_Iterable[_Union[DataPath, str]]] = ..., labels: _Optional[_Mapping[str, str]] = ...) -> None: ...

class CensusWarning(_message.Message):
    __slots__ = ("kind", "message", "other_mode_id", "diffs", "other_namespace_id", "other_namespace")
    KIND_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    OTHER_MODE_ID_FIELD_NUMBER: _ClassVar[int]
    DIFFS_FIELD_NUMBER: _ClassVar[int]
    OTHER_NAMESPACE_ID_FIELD_NUMBER: _ClassVar[int]
    OTHER_NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    kind: str
    message: str
    other_mode_id: str
    diffs: _containers.RepeatedCompositeFieldContainer[FieldDiff]
    other_namespace_id: str
    other_namespace: NamespaceDescriptor
    def __init__(self, kind: _Optional[str] = ..., message: _Optional[str] = ..., other_mode_id: _Optional[str] = ..., diffs: _Optional[_Iterable[_Union[FieldDiff, _Mapping]]] = ..., other_namespace_id: _Optional[str] = ..., other_namespace: _Optional[_Union[NamespaceDescriptor, _Mapping]] = ...) -> None: ...

class OpenSessionResponse(_message.Message):
    __slots__ = ("session_id", "namespace_id", "mode_id", "policy", "warnings", "session_ttl_ms", "data_path", "limits", "shared_memory_offer", "wants_token_ids")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    NAMESPACE_ID_FIELD_NUMBER: _ClassVar[int]
    MODE_ID_FIELD_NUMBER: _ClassVar[int]
    POLICY_FIELD_NUMBER: _ClassVar[int]
    WARNINGS_FIELD_NUMBER: _ClassVar[int]
    SESSION_TTL_MS_FIELD_NUMBER: _ClassVar[int]
    DATA_PATH_FIELD_NUMBER: _ClassVar[int]
    LIMITS_FIELD_NUMBER: _ClassVar[int]
    SHARED_MEMORY_OFFER_FIELD_NUMBER: _ClassVar[int]
    WANTS_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    namespace_id: str
    mode_id: str
    policy: Policy
    warnings: _containers.RepeatedCompositeFieldContainer[CensusWarning]
    session_ttl_ms: int
    data_path: DataPath
    limits: Limits
    shared_memory_offer: SharedMemoryOffer
    wants_token_ids: bool
    def __init__(self, session_id: _Optional[str] = ..., namespace_id: _Optional[str] = ..., mode_id: _Optional[str] = ..., policy: _Optional[_Union[Policy, str]] = ..., warnings: _Optional[_Iterable[_Union[CensusWarning, _Mapping]]] = ..., session_ttl_ms: _Optional[int] = ..., data_path: _Optional[_Union[DataPath, str]] = ..., limits: _Optional[_Union[Limits, _Mapping]] = ..., shared_memory_offer: _Optional[_Union[SharedMemoryOffer, _Mapping]] = ..., wants_token_ids: _Optional[bool] = ...) -> None: ...

class AttachSharedMemoryRequest(_message.Message):
    __slots__ = ("session_id", "nonce")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    NONCE_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    nonce: bytes
    def __init__(self, session_id: _Optional[str] = ..., nonce: _Optional[bytes] = ...) -> None: ...

class AttachSharedMemoryResponse(_message.Message):
    __slots__ = ("data_path",)
    DATA_PATH_FIELD_NUMBER: _ClassVar[int]
    data_path: DataPath
    def __init__(self, data_path: _Optional[_Union[DataPath, str]] = ...) -> None: ...

class SlotRequest(_message.Message):
    __slots__ = ("block", "length")
    BLOCK_FIELD_NUMBER: _ClassVar[int]
    LENGTH_FIELD_NUMBER: _ClassVar[int]
    block: BlockRef
    length: int
    def __init__(self, block: _Optional[_Union[BlockRef, _Mapping]] = ..., length: _Optional[int] = ...) -> None: ...

class ReserveSlotsRequest(_message.Message):
    __slots__ = ("session_id", "items", "packed_items", "packed_lengths")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    ITEMS_FIELD_NUMBER: _ClassVar[int]
    PACKED_ITEMS_FIELD_NUMBER: _ClassVar[int]
    PACKED_LENGTHS_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    items: _containers.RepeatedCompositeFieldContainer[SlotRequest]
    packed_items: _containers.RepeatedCompositeFieldContainer[PackedBlocks]
    packed_lengths: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, session_id: _Optional[str] = ..., items: _Optional[_Iterable[_Union[SlotRequest, _Mapping]]] = ..., packed_items: _Optional[_Iterable[_Union[PackedBlocks, _Mapping]]] = ..., packed_lengths: _Optional[_Iterable[int]] = ...) -> None: ...

class PackedGrants(_message.Message):
    __slots__ = ("statuses", "segment", "offsets", "generations", "reasons")
    STATUSES_FIELD_NUMBER: _ClassVar[int]
    SEGMENT_FIELD_NUMBER: _ClassVar[int]
    OFFSETS_FIELD_NUMBER: _ClassVar[int]
    GENERATIONS_FIELD_NUMBER: _ClassVar[int]
    REASONS_FIELD_NUMBER: _ClassVar[int]
    statuses: bytes
    segment: str
    offsets: _containers.RepeatedScalarFieldContainer[int]
    generations: _containers.RepeatedScalarFieldContainer[int]
    reasons: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, statuses: _Optional[bytes] = ..., segment: _Optional[str] = ..., offsets: _Optional[_Iterable[int]] = ..., generations: _Optional[_Iterable[int]] = ..., reasons: _Optional[_Iterable[str]] = ...) -> None: ...

class SlotGrant(_message.Message):
    __slots__ = ("status", "reason", "slot")
    STATUS_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    SLOT_FIELD_NUMBER: _ClassVar[int]
    status: PutStatus
    reason: str
    slot: SharedMemoryRef
    def __init__(self, status: _Optional[_Union[PutStatus, str]] = ..., reason: _Optional[str] = ..., slot: _Optional[_Union[SharedMemoryRef, _Mapping]] = ...) -> None: ...

class CommitSlotsRequest(_message.Message):
    __slots__ = ("session_id", "generations", "xxh3_64", "packed_items", "spare_lengths", "cancel_generations")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    GENERATIONS_FIELD_NUMBER: _ClassVar[int]
    XXH3_64_FIELD_NUMBER: _ClassVar[int]
    PACKED_ITEMS_FIELD_NUMBER: _ClassVar[int]
    SPARE_LENGTHS_FIELD_NUMBER: _ClassVar[int]
    CANCEL_GENERATIONS_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    generations: _containers.RepeatedScalarFieldContainer[int]
    xxh3_64: _containers.RepeatedScalarFieldContainer[int]
    packed_items: _containers.RepeatedCompositeFieldContainer[PackedBlocks]
    spare_lengths: _containers.RepeatedScalarFieldContainer[int]
    cancel_generations: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, session_id: _Optional[str] = ..., generations: _Optional[_Iterable[int]] = ..., xxh3_64: _Optional[_Iterable[int]] = ..., packed_items: _Optional[_Iterable[_Union[PackedBlocks, _Mapping]]] = ..., spare_lengths: _Optional[_Iterable[int]] = ..., cancel_generations: _Optional[_Iterable[int]] = ...) -> None: ...

class CommitSlotsResponse(_message.Message):
    __slots__ = ("results", "spare", "packed_statuses", "packed_reasons")
    RESULTS_FIELD_NUMBER: _ClassVar[int]
    SPARE_FIELD_NUMBER: _ClassVar[int]
    PACKED_STATUSES_FIELD_NUMBER: _ClassVar[int]
    PACKED_REASONS_FIELD_NUMBER: _ClassVar[int]
    results: _containers.RepeatedCompositeFieldContainer[PutResult]
    spare: PackedGrants
    packed_statuses: bytes
    packed_reasons: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, results: _Optional[_Iterable[_Union[PutResult, _Mapping]]] = ..., spare: _Optional[_Union[PackedGrants, _Mapping]] = ..., packed_statuses: _Optional[bytes] = ..., packed_reasons: _Optional[_Iterable[str]] = ...) -> None: ...

class ReserveSlotsResponse(_message.Message):
    __slots__ = ("grants", "packed")
    GRANTS_FIELD_NUMBER: _ClassVar[int]
    PACKED_FIELD_NUMBER: _ClassVar[int]
    grants: _containers.RepeatedCompositeFieldContainer[SlotGrant]
    packed: PackedGrants
    def __init__(self, grants: _Optional[_Iterable[_Union[SlotGrant, _Mapping]]] = ..., packed: _Optional[_Union[PackedGrants, _Mapping]] = ...) -> None: ...

class GetReferencesResponse(_message.Message):
    __slots__ = ("results", "lease", "packed")
    RESULTS_FIELD_NUMBER: _ClassVar[int]
    LEASE_FIELD_NUMBER: _ClassVar[int]
    PACKED_FIELD_NUMBER: _ClassVar[int]
    results: _containers.RepeatedCompositeFieldContainer[GetReference]
    lease: Lease
    packed: PackedReferences
    def __init__(self, results: _Optional[_Iterable[_Union[GetReference, _Mapping]]] = ..., lease: _Optional[_Union[Lease, _Mapping]] = ..., packed: _Optional[_Union[PackedReferences, _Mapping]] = ...) -> None: ...

class GetReference(_message.Message):
    __slots__ = ("status", "slot", "xxh3_64")
    STATUS_FIELD_NUMBER: _ClassVar[int]
    SLOT_FIELD_NUMBER: _ClassVar[int]
    XXH3_64_FIELD_NUMBER: _ClassVar[int]
    status: KeyStatus
    slot: SharedMemoryRef
    xxh3_64: int
    def __init__(self, status: _Optional[_Union[KeyStatus, str]] = ..., slot: _Optional[_Union[SharedMemoryRef, _Mapping]] = ..., xxh3_64: _Optional[int] = ...) -> None: ...

class HeartbeatRequest(_message.Message):
    __slots__ = ("session_id", "usage")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    USAGE_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    usage: UsageReport
    def __init__(self, session_id: _Optional[str] = ..., usage: _Optional[_Union[UsageReport, _Mapping]] = ...) -> None: ...

class UsageReport(_message.Message):
    __slots__ = ("lookups", "hit_blocks", "missed_blocks", "stored_blocks", "stored_base_keys", "missed_base_keys", "base_keys_dropped")
    LOOKUPS_FIELD_NUMBER: _ClassVar[int]
    HIT_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    MISSED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    STORED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    STORED_BASE_KEYS_FIELD_NUMBER: _ClassVar[int]
    MISSED_BASE_KEYS_FIELD_NUMBER: _ClassVar[int]
    BASE_KEYS_DROPPED_FIELD_NUMBER: _ClassVar[int]
    lookups: int
    hit_blocks: int
    missed_blocks: int
    stored_blocks: int
    stored_base_keys: _containers.RepeatedCompositeFieldContainer[UsageBlock]
    missed_base_keys: _containers.RepeatedCompositeFieldContainer[UsageBlock]
    base_keys_dropped: int
    def __init__(self, lookups: _Optional[int] = ..., hit_blocks: _Optional[int] = ..., missed_blocks: _Optional[int] = ..., stored_blocks: _Optional[int] = ..., stored_base_keys: _Optional[_Iterable[_Union[UsageBlock, _Mapping]]] = ..., missed_base_keys: _Optional[_Iterable[_Union[UsageBlock, _Mapping]]] = ..., base_keys_dropped: _Optional[int] = ...) -> None: ...

class UsageBlock(_message.Message):
    __slots__ = ("group", "base_key")
    GROUP_FIELD_NUMBER: _ClassVar[int]
    BASE_KEY_FIELD_NUMBER: _ClassVar[int]
    group: int
    base_key: bytes
    def __init__(self, group: _Optional[int] = ..., base_key: _Optional[bytes] = ...) -> None: ...

class HeartbeatResponse(_message.Message):
    __slots__ = ("session_ttl_ms",)
    SESSION_TTL_MS_FIELD_NUMBER: _ClassVar[int]
    session_ttl_ms: int
    def __init__(self, session_ttl_ms: _Optional[int] = ...) -> None: ...

class CloseSessionRequest(_message.Message):
    __slots__ = ("session_id",)
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    def __init__(self, session_id: _Optional[str] = ...) -> None: ...

class CloseSessionResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class BlockRef(_message.Message):
    __slots__ = ("key", "group", "base_key", "token_ids")
    KEY_FIELD_NUMBER: _ClassVar[int]
    GROUP_FIELD_NUMBER: _ClassVar[int]
    BASE_KEY_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    key: bytes
    group: int
    base_key: bytes
    token_ids: bytes
    def __init__(self, key: _Optional[bytes] = ..., group: _Optional[int] = ..., base_key: _Optional[bytes] = ..., token_ids: _Optional[bytes] = ...) -> None: ...

class PackedBlocks(_message.Message):
    __slots__ = ("key_length", "keys", "group", "base_keys", "token_ids")
    KEY_LENGTH_FIELD_NUMBER: _ClassVar[int]
    KEYS_FIELD_NUMBER: _ClassVar[int]
    GROUP_FIELD_NUMBER: _ClassVar[int]
    BASE_KEYS_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    key_length: int
    keys: bytes
    group: int
    base_keys: bytes
    token_ids: bytes
    def __init__(self, key_length: _Optional[int] = ..., keys: _Optional[bytes] = ..., group: _Optional[int] = ..., base_keys: _Optional[bytes] = ..., token_ids: _Optional[bytes] = ...) -> None: ...

class LookupRequest(_message.Message):
    __slots__ = ("session_id", "blocks", "lease_ms", "packed_blocks")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_FIELD_NUMBER: _ClassVar[int]
    LEASE_MS_FIELD_NUMBER: _ClassVar[int]
    PACKED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    blocks: _containers.RepeatedCompositeFieldContainer[BlockRef]
    lease_ms: int
    packed_blocks: _containers.RepeatedCompositeFieldContainer[PackedBlocks]
    def __init__(self, session_id: _Optional[str] = ..., blocks: _Optional[_Iterable[_Union[BlockRef, _Mapping]]] = ..., lease_ms: _Optional[int] = ..., packed_blocks: _Optional[_Iterable[_Union[PackedBlocks, _Mapping]]] = ...) -> None: ...

class Lease(_message.Message):
    __slots__ = ("lease_id", "expires_in_ms")
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    EXPIRES_IN_MS_FIELD_NUMBER: _ClassVar[int]
    lease_id: str
    expires_in_ms: int
    def __init__(self, lease_id: _Optional[str] = ..., expires_in_ms: _Optional[int] = ...) -> None: ...

class LookupResponse(_message.Message):
    __slots__ = ("prefix_length", "statuses", "lease", "packed_statuses")
    PREFIX_LENGTH_FIELD_NUMBER: _ClassVar[int]
    STATUSES_FIELD_NUMBER: _ClassVar[int]
    LEASE_FIELD_NUMBER: _ClassVar[int]
    PACKED_STATUSES_FIELD_NUMBER: _ClassVar[int]
    prefix_length: int
    statuses: _containers.RepeatedScalarFieldContainer[KeyStatus]
    lease: Lease
    packed_statuses: bytes
    def __init__(self, prefix_length: _Optional[int] = ..., statuses: _Optional[_Iterable[_Union[KeyStatus, str]]] = ..., lease: _Optional[_Union[Lease, _Mapping]] = ..., packed_statuses: _Optional[bytes] = ...) -> None: ...

class PutItem(_message.Message):
    __slots__ = ("block", "value", "shared_memory")
    BLOCK_FIELD_NUMBER: _ClassVar[int]
    VALUE_FIELD_NUMBER: _ClassVar[int]
    SHARED_MEMORY_FIELD_NUMBER: _ClassVar[int]
    block: BlockRef
    value: bytes
    shared_memory: SharedMemoryRef
    def __init__(self, block: _Optional[_Union[BlockRef, _Mapping]] = ..., value: _Optional[bytes] = ..., shared_memory: _Optional[_Union[SharedMemoryRef, _Mapping]] = ...) -> None: ...

class PutRequest(_message.Message):
    __slots__ = ("session_id", "items")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    ITEMS_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    items: _containers.RepeatedCompositeFieldContainer[PutItem]
    def __init__(self, session_id: _Optional[str] = ..., items: _Optional[_Iterable[_Union[PutItem, _Mapping]]] = ...) -> None: ...

class PutResult(_message.Message):
    __slots__ = ("status", "reason")
    STATUS_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    status: PutStatus
    reason: str
    def __init__(self, status: _Optional[_Union[PutStatus, str]] = ..., reason: _Optional[str] = ...) -> None: ...

class PutResponse(_message.Message):
    __slots__ = ("results",)
    RESULTS_FIELD_NUMBER: _ClassVar[int]
    results: _containers.RepeatedCompositeFieldContainer[PutResult]
    def __init__(self, results: _Optional[_Iterable[_Union[PutResult, _Mapping]]] = ...) -> None: ...

class GetRequest(_message.Message):
    __slots__ = ("session_id", "blocks", "lease_id", "verify_in_client", "packed_blocks")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_FIELD_NUMBER: _ClassVar[int]
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    VERIFY_IN_CLIENT_FIELD_NUMBER: _ClassVar[int]
    PACKED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    blocks: _containers.RepeatedCompositeFieldContainer[BlockRef]
    lease_id: str
    verify_in_client: bool
    packed_blocks: _containers.RepeatedCompositeFieldContainer[PackedBlocks]
    def __init__(self, session_id: _Optional[str] = ..., blocks: _Optional[_Iterable[_Union[BlockRef, _Mapping]]] = ..., lease_id: _Optional[str] = ..., verify_in_client: _Optional[bool] = ..., packed_blocks: _Optional[_Iterable[_Union[PackedBlocks, _Mapping]]] = ...) -> None: ...

class PackedReferences(_message.Message):
    __slots__ = ("statuses", "segment", "offsets", "lengths", "generations", "xxh3_64")
    STATUSES_FIELD_NUMBER: _ClassVar[int]
    SEGMENT_FIELD_NUMBER: _ClassVar[int]
    OFFSETS_FIELD_NUMBER: _ClassVar[int]
    LENGTHS_FIELD_NUMBER: _ClassVar[int]
    GENERATIONS_FIELD_NUMBER: _ClassVar[int]
    XXH3_64_FIELD_NUMBER: _ClassVar[int]
    statuses: bytes
    segment: str
    offsets: _containers.RepeatedScalarFieldContainer[int]
    lengths: _containers.RepeatedScalarFieldContainer[int]
    generations: _containers.RepeatedScalarFieldContainer[int]
    xxh3_64: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, statuses: _Optional[bytes] = ..., segment: _Optional[str] = ..., offsets: _Optional[_Iterable[int]] = ..., lengths: _Optional[_Iterable[int]] = ..., generations: _Optional[_Iterable[int]] = ..., xxh3_64: _Optional[_Iterable[int]] = ...) -> None: ...

class GetResult(_message.Message):
    __slots__ = ("status", "value")
    STATUS_FIELD_NUMBER: _ClassVar[int]
    VALUE_FIELD_NUMBER: _ClassVar[int]
    status: KeyStatus
    value: bytes
    def __init__(self, status: _Optional[_Union[KeyStatus, str]] = ..., value: _Optional[bytes] = ...) -> None: ...

class GetResponse(_message.Message):
    __slots__ = ("results",)
    RESULTS_FIELD_NUMBER: _ClassVar[int]
    results: _containers.RepeatedCompositeFieldContainer[GetResult]
    def __init__(self, results: _Optional[_Iterable[_Union[GetResult, _Mapping]]] = ...) -> None: ...

class ReleaseLeasesRequest(_message.Message):
    __slots__ = ("session_id", "lease_ids")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    LEASE_IDS_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    lease_ids: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, session_id: _Optional[str] = ..., lease_ids: _Optional[_Iterable[str]] = ...) -> None: ...

class ReleaseLeasesResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class FieldDiff(_message.Message):
    __slots__ = ("field", "established", "requested")
    FIELD_FIELD_NUMBER: _ClassVar[int]
    ESTABLISHED_FIELD_NUMBER: _ClassVar[int]
    REQUESTED_FIELD_NUMBER: _ClassVar[int]
    field: str
    established: str
    requested: str
    def __init__(self, field: _Optional[str] = ..., established: _Optional[str] = ..., requested: _Optional[str] = ...) -> None: ...

class ModeRefusal(_message.Message):
    __slots__ = ("namespace_id", "established_mode_id", "requested_mode_id", "diffs")
    NAMESPACE_ID_FIELD_NUMBER: _ClassVar[int]
    ESTABLISHED_MODE_ID_FIELD_NUMBER: _ClassVar[int]
    REQUESTED_MODE_ID_FIELD_NUMBER: _ClassVar[int]
    DIFFS_FIELD_NUMBER: _ClassVar[int]
    namespace_id: str
    established_mode_id: str
    requested_mode_id: str
    diffs: _containers.RepeatedCompositeFieldContainer[FieldDiff]
    def __init__(self, namespace_id: _Optional[str] = ..., established_mode_id: _Optional[str] = ..., requested_mode_id: _Optional[str] = ..., diffs: _Optional[_Iterable[_Union[FieldDiff, _Mapping]]] = ...) -> None: ...

class ProbeDisagreement(_message.Message):
    __slots__ = ("namespace_id", "mode_id", "reference_engine_id", "engine_id", "likely_cause", "at_unix_ms")
    NAMESPACE_ID_FIELD_NUMBER: _ClassVar[int]
    MODE_ID_FIELD_NUMBER: _ClassVar[int]
    REFERENCE_ENGINE_ID_FIELD_NUMBER: _ClassVar[int]
    ENGINE_ID_FIELD_NUMBER: _ClassVar[int]
    LIKELY_CAUSE_FIELD_NUMBER: _ClassVar[int]
    AT_UNIX_MS_FIELD_NUMBER: _ClassVar[int]
    namespace_id: str
    mode_id: str
    reference_engine_id: str
    engine_id: str
    likely_cause: str
    at_unix_ms: int
    def __init__(self, namespace_id: _Optional[str] = ..., mode_id: _Optional[str] = ..., reference_engine_id: _Optional[str] = ..., engine_id: _Optional[str] = ..., likely_cause: _Optional[str] = ..., at_unix_ms: _Optional[int] = ...) -> None: ...

class EngineRecord(_message.Message):
    __slots__ = ("engine_id", "session_id", "live", "opened_unix_ms", "last_seen_unix_ms", "labels")
    class LabelsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    ENGINE_ID_FIELD_NUMBER: _ClassVar[int]
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    LIVE_FIELD_NUMBER: _ClassVar[int]
    OPENED_UNIX_MS_FIELD_NUMBER: _ClassVar[int]
    LAST_SEEN_UNIX_MS_FIELD_NUMBER: _ClassVar[int]
    LABELS_FIELD_NUMBER: _ClassVar[int]
    engine_id: str
    session_id: str
    live: bool
    opened_unix_ms: int
    last_seen_unix_ms: int
    labels: _containers.ScalarMap[str, str]
    def __init__(self, engine_id: _Optional[str] = ..., session_id: _Optional[str] = ..., live: _Optional[bool] = ..., opened_unix_ms: _Optional[int] = ..., last_seen_unix_ms: _Optional[int] = ..., labels: _Optional[_Mapping[str, str]] = ...) -> None: ...

class RefusedSession(_message.Message):
    __slots__ = ("engine_id", "reason", "refusal", "at_unix_ms")
    ENGINE_ID_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    REFUSAL_FIELD_NUMBER: _ClassVar[int]
    AT_UNIX_MS_FIELD_NUMBER: _ClassVar[int]
    engine_id: str
    reason: str
    refusal: ModeRefusal
    at_unix_ms: int
    def __init__(self, engine_id: _Optional[str] = ..., reason: _Optional[str] = ..., refusal: _Optional[_Union[ModeRefusal, _Mapping]] = ..., at_unix_ms: _Optional[int] = ...) -> None: ...

class CrossModeMiss(_message.Message):
    __slots__ = ("held_by_mode_id", "count")
    HELD_BY_MODE_ID_FIELD_NUMBER: _ClassVar[int]
    COUNT_FIELD_NUMBER: _ClassVar[int]
    held_by_mode_id: str
    count: int
    def __init__(self, held_by_mode_id: _Optional[str] = ..., count: _Optional[int] = ...) -> None: ...

class ModeCounters(_message.Message):
    __slots__ = ("hits", "misses", "mode_mismatches", "cross_mode_misses", "conflicts", "stored")
    HITS_FIELD_NUMBER: _ClassVar[int]
    MISSES_FIELD_NUMBER: _ClassVar[int]
    MODE_MISMATCHES_FIELD_NUMBER: _ClassVar[int]
    CROSS_MODE_MISSES_FIELD_NUMBER: _ClassVar[int]
    CONFLICTS_FIELD_NUMBER: _ClassVar[int]
    STORED_FIELD_NUMBER: _ClassVar[int]
    hits: int
    misses: int
    mode_mismatches: int
    cross_mode_misses: int
    conflicts: int
    stored: int
    def __init__(self, hits: _Optional[int] = ..., misses: _Optional[int] = ..., mode_mismatches: _Optional[int] = ..., cross_mode_misses: _Optional[int] = ..., conflicts: _Optional[int] = ..., stored: _Optional[int] = ...) -> None: ...

class ModeReport(_message.Message):
    __slots__ = ("mode_id", "mode", "engines", "counters", "cross_mode_misses", "engines_forgotten")
    MODE_ID_FIELD_NUMBER: _ClassVar[int]
    MODE_FIELD_NUMBER: _ClassVar[int]
    ENGINES_FIELD_NUMBER: _ClassVar[int]
    COUNTERS_FIELD_NUMBER: _ClassVar[int]
    CROSS_MODE_MISSES_FIELD_NUMBER: _ClassVar[int]
    ENGINES_FORGOTTEN_FIELD_NUMBER: _ClassVar[int]
    mode_id: str
    mode: HashingMode
    engines: _containers.RepeatedCompositeFieldContainer[EngineRecord]
    counters: ModeCounters
    cross_mode_misses: _containers.RepeatedCompositeFieldContainer[CrossModeMiss]
    engines_forgotten: int
    def __init__(self, mode_id: _Optional[str] = ..., mode: _Optional[_Union[HashingMode, _Mapping]] = ..., engines: _Optional[_Iterable[_Union[EngineRecord, _Mapping]]] = ..., counters: _Optional[_Union[ModeCounters, _Mapping]] = ..., cross_mode_misses: _Optional[_Iterable[_Union[CrossModeMiss, _Mapping]]] = ..., engines_forgotten: _Optional[int] = ...) -> None: ...

class NamespaceReport(_message.Message):
    __slots__ = ("namespace_id", "namespace", "policy", "established_mode_id", "modes", "refused", "probe_disagreements", "last_active_unix_ms", "modes_forgotten")
    NAMESPACE_ID_FIELD_NUMBER: _ClassVar[int]
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    POLICY_FIELD_NUMBER: _ClassVar[int]
    ESTABLISHED_MODE_ID_FIELD_NUMBER: _ClassVar[int]
    MODES_FIELD_NUMBER: _ClassVar[int]
    REFUSED_FIELD_NUMBER: _ClassVar[int]
    PROBE_DISAGREEMENTS_FIELD_NUMBER: _ClassVar[int]
    LAST_ACTIVE_UNIX_MS_FIELD_NUMBER: _ClassVar[int]
    MODES_FORGOTTEN_FIELD_NUMBER: _ClassVar[int]
    namespace_id: str
    namespace: NamespaceDescriptor
    policy: Policy
    established_mode_id: str
    modes: _containers.RepeatedCompositeFieldContainer[ModeReport]
    refused: _containers.RepeatedCompositeFieldContainer[RefusedSession]
    probe_disagreements: _containers.RepeatedCompositeFieldContainer[ProbeDisagreement]
    last_active_unix_ms: int
    modes_forgotten: int
    def __init__(self, namespace_id: _Optional[str] = ..., namespace: _Optional[_Union[NamespaceDescriptor, _Mapping]] = ..., policy: _Optional[_Union[Policy, str]] = ..., established_mode_id: _Optional[str] = ..., modes: _Optional[_Iterable[_Union[ModeReport, _Mapping]]] = ..., refused: _Optional[_Iterable[_Union[RefusedSession, _Mapping]]] = ..., probe_disagreements: _Optional[_Iterable[_Union[ProbeDisagreement, _Mapping]]] = ..., last_active_unix_ms: _Optional[int] = ..., modes_forgotten: _Optional[int] = ...) -> None: ...

class DiagnoseRequest(_message.Message):
    __slots__ = ("namespace_id", "filter", "page_size", "page_token")
    NAMESPACE_ID_FIELD_NUMBER: _ClassVar[int]
    FILTER_FIELD_NUMBER: _ClassVar[int]
    PAGE_SIZE_FIELD_NUMBER: _ClassVar[int]
    PAGE_TOKEN_FIELD_NUMBER: _ClassVar[int]
    namespace_id: str
    filter: str
    page_size: int
    page_token: str
    def __init__(self, namespace_id: _Optional[str] = ..., filter: _Optional[str] = ..., page_size: _Optional[int] = ..., page_token: _Optional[str] = ...) -> None: ...

class DiagnoseResponse(_message.Message):
    __slots__ = ("namespaces", "next_page_token", "total_namespaces")
    NAMESPACES_FIELD_NUMBER: _ClassVar[int]
    NEXT_PAGE_TOKEN_FIELD_NUMBER: _ClassVar[int]
    TOTAL_NAMESPACES_FIELD_NUMBER: _ClassVar[int]
    namespaces: _containers.RepeatedCompositeFieldContainer[NamespaceReport]
    next_page_token: str
    total_namespaces: int
    def __init__(self, namespaces: _Optional[_Iterable[_Union[NamespaceReport, _Mapping]]] = ..., next_page_token: _Optional[str] = ..., total_namespaces: _Optional[int] = ...) -> None: ...

class GetStatsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class NamespaceStats(_message.Message):
    __slots__ = ("namespace_id", "keys", "used_bytes", "tenant")
    NAMESPACE_ID_FIELD_NUMBER: _ClassVar[int]
    KEYS_FIELD_NUMBER: _ClassVar[int]
    USED_BYTES_FIELD_NUMBER: _ClassVar[int]
    TENANT_FIELD_NUMBER: _ClassVar[int]
    namespace_id: str
    keys: int
    used_bytes: int
    tenant: str
    def __init__(self, namespace_id: _Optional[str] = ..., keys: _Optional[int] = ..., used_bytes: _Optional[int] = ..., tenant: _Optional[str] = ...) -> None: ...

class TenantStats(_message.Message):
    __slots__ = ("tenant", "keys", "used_bytes", "quota_bytes", "evictions")
    TENANT_FIELD_NUMBER: _ClassVar[int]
    KEYS_FIELD_NUMBER: _ClassVar[int]
    USED_BYTES_FIELD_NUMBER: _ClassVar[int]
    QUOTA_BYTES_FIELD_NUMBER: _ClassVar[int]
    EVICTIONS_FIELD_NUMBER: _ClassVar[int]
    tenant: str
    keys: int
    used_bytes: int
    quota_bytes: int
    evictions: int
    def __init__(self, tenant: _Optional[str] = ..., keys: _Optional[int] = ..., used_bytes: _Optional[int] = ..., quota_bytes: _Optional[int] = ..., evictions: _Optional[int] = ...) -> None: ...

class GetStatsResponse(_message.Message):
    __slots__ = ("backend", "capacity_bytes", "used_bytes", "keys", "evictions", "leased_keys", "corrupted_dropped", "namespaces", "tenants", "reserved_bytes", "spare_bytes", "tiers", "prefault_done_bytes", "prefault_total_bytes")
    BACKEND_FIELD_NUMBER: _ClassVar[int]
    CAPACITY_BYTES_FIELD_NUMBER: _ClassVar[int]
    USED_BYTES_FIELD_NUMBER: _ClassVar[int]
    KEYS_FIELD_NUMBER: _ClassVar[int]
    EVICTIONS_FIELD_NUMBER: _ClassVar[int]
    LEASED_KEYS_FIELD_NUMBER: _ClassVar[int]
    CORRUPTED_DROPPED_FIELD_NUMBER: _ClassVar[int]
    NAMESPACES_FIELD_NUMBER: _ClassVar[int]
    TENANTS_FIELD_NUMBER: _ClassVar[int]
    RESERVED_BYTES_FIELD_NUMBER: _ClassVar[int]
    SPARE_BYTES_FIELD_NUMBER: _ClassVar[int]
    TIERS_FIELD_NUMBER: _ClassVar[int]
    PREFAULT_DONE_BYTES_FIELD_NUMBER: _ClassVar[int]
    PREFAULT_TOTAL_BYTES_FIELD_NUMBER: _ClassVar[int]
    backend: str
    capacity_bytes: int
    used_bytes: int
    keys: int
    evictions: int
    leased_keys: int
    corrupted_dropped: int
    namespaces: _containers.RepeatedCompositeFieldContainer[NamespaceStats]
    tenants: _containers.RepeatedCompositeFieldContainer[TenantStats]
    reserved_bytes: int
    spare_bytes: int
    tiers: _containers.RepeatedCompositeFieldContainer[TierStats]
    prefault_done_bytes: int
    prefault_total_bytes: int
    def __init__(self, backend: _Optional[str] = ..., capacity_bytes: _Optional[int] = ..., used_bytes: _Optional[int] = ..., keys: _Optional[int] = ..., evictions: _Optional[int] = ..., leased_keys: _Optional[int] = ..., corrupted_dropped: _Optional[int] = ..., namespaces: _Optional[_Iterable[_Union[NamespaceStats, _Mapping]]] = ..., tenants: _Optional[_Iterable[_Union[TenantStats, _Mapping]]] = ..., reserved_bytes: _Optional[int] = ..., spare_bytes: _Optional[int] = ..., tiers: _Optional[_Iterable[_Union[TierStats, _Mapping]]] = ..., prefault_done_bytes: _Optional[int] = ..., prefault_total_bytes: _Optional[int] = ...) -> None: ...

class TierStats(_message.Message):
    __slots__ = ("tier", "used_bytes", "capacity_bytes", "keys", "hits", "spills", "reads_back", "corrupted_dropped", "evictions", "failures", "degraded", "degraded_reason")
    TIER_FIELD_NUMBER: _ClassVar[int]
    USED_BYTES_FIELD_NUMBER: _ClassVar[int]
    CAPACITY_BYTES_FIELD_NUMBER: _ClassVar[int]
    KEYS_FIELD_NUMBER: _ClassVar[int]
    HITS_FIELD_NUMBER: _ClassVar[int]
    SPILLS_FIELD_NUMBER: _ClassVar[int]
    READS_BACK_FIELD_NUMBER: _ClassVar[int]
    CORRUPTED_DROPPED_FIELD_NUMBER: _ClassVar[int]
    EVICTIONS_FIELD_NUMBER: _ClassVar[int]
    FAILURES_FIELD_NUMBER: _ClassVar[int]
    DEGRADED_FIELD_NUMBER: _ClassVar[int]
    DEGRADED_REASON_FIELD_NUMBER: _ClassVar[int]
    tier: str
    used_bytes: int
    capacity_bytes: int
    keys: int
    hits: int
    spills: int
    reads_back: int
    corrupted_dropped: int
    evictions: int
    failures: int
    degraded: bool
    degraded_reason: str
    def __init__(self, tier: _Optional[str] = ..., used_bytes: _Optional[int] = ..., capacity_bytes: _Optional[int] = ..., keys: _Optional[int] = ..., hits: _Optional[int] = ..., spills: _Optional[int] = ..., reads_back: _Optional[int] = ..., corrupted_dropped: _Optional[int] = ..., evictions: _Optional[int] = ..., failures: _Optional[int] = ..., degraded: _Optional[bool] = ..., degraded_reason: _Optional[str] = ...) -> None: ...
