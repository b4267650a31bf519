from common.pb.quadriga.v1 import generation_pb2 as _generation_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class ReplicaCapacity(_message.Message):
    __slots__ = ("max_num_seqs", "num_kv_blocks", "block_size", "max_batch_tokens", "max_model_len", "prefetch")
    MAX_NUM_SEQS_FIELD_NUMBER: _ClassVar[int]
    NUM_KV_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    MAX_BATCH_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MAX_MODEL_LEN_FIELD_NUMBER: _ClassVar[int]
    PREFETCH_FIELD_NUMBER: _ClassVar[int]
    max_num_seqs: int
    num_kv_blocks: int
    block_size: int
    max_batch_tokens: int
    max_model_len: int
    prefetch: int
    def __init__(self, max_num_seqs: _Optional[int] = ..., num_kv_blocks: _Optional[int] = ..., block_size: _Optional[int] = ..., max_batch_tokens: _Optional[int] = ..., max_model_len: _Optional[int] = ..., prefetch: _Optional[int] = ...) -> None: ...

class Register(_message.Message):
    __slots__ = ("replica_id", "model", "capacity", "scheduler", "auth_token", "held_request_ids", "prefix_cache")
    REPLICA_ID_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    CAPACITY_FIELD_NUMBER: _ClassVar[int]
    SCHEDULER_FIELD_NUMBER: _ClassVar[int]
    AUTH_TOKEN_FIELD_NUMBER: _ClassVar[int]
    HELD_REQUEST_IDS_FIELD_NUMBER: _ClassVar[int]
    PREFIX_CACHE_FIELD_NUMBER: _ClassVar[int]
    replica_id: str
    model: str
    capacity: ReplicaCapacity
    scheduler: str
    auth_token: str
    held_request_ids: _containers.RepeatedScalarFieldContainer[str]
    prefix_cache: PrefixCache
    def __init__(self, replica_id: _Optional[str] = ..., model: _Optional[str] = ..., capacity: _Optional[_Union[ReplicaCapacity, _Mapping]] = ..., scheduler: _Optional[str] = ..., auth_token: _Optional[str] = ..., held_request_ids: _Optional[_Iterable[str]] = ..., prefix_cache: _Optional[_Union[PrefixCache, _Mapping]] = ...) -> None: ...

class PrefixCache(_message.Message):
    __slots__ = ("block_size", "hash_scheme", "hash_salt", "block_hashes")
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    HASH_SCHEME_FIELD_NUMBER: _ClassVar[int]
    HASH_SALT_FIELD_NUMBER: _ClassVar[int]
    BLOCK_HASHES_FIELD_NUMBER: _ClassVar[int]
    block_size: int
    hash_scheme: str
    hash_salt: bytes
    block_hashes: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, block_size: _Optional[int] = ..., hash_scheme: _Optional[str] = ..., hash_salt: _Optional[bytes] = ..., block_hashes: _Optional[_Iterable[int]] = ...) -> None: ...

class KVEvents(_message.Message):
    __slots__ = ("stored", "evicted", "cleared")
    STORED_FIELD_NUMBER: _ClassVar[int]
    EVICTED_FIELD_NUMBER: _ClassVar[int]
    CLEARED_FIELD_NUMBER: _ClassVar[int]
    stored: _containers.RepeatedScalarFieldContainer[int]
    evicted: _containers.RepeatedScalarFieldContainer[int]
    cleared: bool
    def __init__(self, stored: _Optional[_Iterable[int]] = ..., evicted: _Optional[_Iterable[int]] = ..., cleared: _Optional[bool] = ...) -> None: ...

class Pull(_message.Message):
    __slots__ = ("max_requests", "max_prompt_tokens")
    MAX_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    MAX_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    max_requests: int
    max_prompt_tokens: int
    def __init__(self, max_requests: _Optional[int] = ..., max_prompt_tokens: _Optional[int] = ...) -> None: ...

class Heartbeat(_message.Message):
    __slots__ = ("running", "waiting", "free_kv_blocks", "total_kv_blocks", "request_ids")
    RUNNING_FIELD_NUMBER: _ClassVar[int]
    WAITING_FIELD_NUMBER: _ClassVar[int]
    FREE_KV_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    TOTAL_KV_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    REQUEST_IDS_FIELD_NUMBER: _ClassVar[int]
    running: int
    waiting: int
    free_kv_blocks: int
    total_kv_blocks: int
    request_ids: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, running: _Optional[int] = ..., waiting: _Optional[int] = ..., free_kv_blocks: _Optional[int] = ..., total_kv_blocks: _Optional[int] = ..., request_ids: _Optional[_Iterable[str]] = ...) -> None: ...

class RequestDelta(_message.Message):
    __slots__ = ("request_id", "token_ids", "text", "output_offset", "finish_reason", "error", "first_scheduled_at", "preemptions", "logprobs", "cached_tokens")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_OFFSET_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    FIRST_SCHEDULED_AT_FIELD_NUMBER: _ClassVar[int]
    PREEMPTIONS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    text: str
    output_offset: int
    finish_reason: _generation_pb2.FinishReason
    error: str
    first_scheduled_at: float
    preemptions: int
    logprobs: _containers.RepeatedCompositeFieldContainer[_generation_pb2.TokenLogprobs]
    cached_tokens: int
    def __init__(self, request_id: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., text: _Optional[str] = ..., output_offset: _Optional[int] = ..., finish_reason: _Optional[_Union[_generation_pb2.FinishReason, str]] = ..., error: _Optional[str] = ..., first_scheduled_at: _Optional[float] = ..., preemptions: _Optional[int] = ..., logprobs: _Optional[_Iterable[_Union[_generation_pb2.TokenLogprobs, _Mapping]]] = ..., cached_tokens: _Optional[int] = ...) -> None: ...

class StepOutputs(_message.Message):
    __slots__ = ("step_id", "deltas", "batch_size", "num_tokens", "step_time_s", "free_kv_blocks", "kv_events", "pull")
    STEP_ID_FIELD_NUMBER: _ClassVar[int]
    DELTAS_FIELD_NUMBER: _ClassVar[int]
    BATCH_SIZE_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    STEP_TIME_S_FIELD_NUMBER: _ClassVar[int]
    FREE_KV_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    KV_EVENTS_FIELD_NUMBER: _ClassVar[int]
    PULL_FIELD_NUMBER: _ClassVar[int]
    step_id: int
    deltas: _containers.RepeatedCompositeFieldContainer[RequestDelta]
    batch_size: int
    num_tokens: int
    step_time_s: float
    free_kv_blocks: int
    kv_events: KVEvents
    pull: Pull
    def __init__(self, step_id: _Optional[int] = ..., deltas: _Optional[_Iterable[_Union[RequestDelta, _Mapping]]] = ..., batch_size: _Optional[int] = ..., num_tokens: _Optional[int] = ..., step_time_s: _Optional[float] = ..., free_kv_blocks: _Optional[int] = ..., kv_events: _Optional[_Union[KVEvents, _Mapping]] = ..., pull: _Optional[_Union[Pull, _Mapping]] = ...) -> None: ...

class HandBack(_message.Message):
    __slots__ = ("request_ids",)
    REQUEST_IDS_FIELD_NUMBER: _ClassVar[int]
    request_ids: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, request_ids: _Optional[_Iterable[str]] = ...) -> None: ...

class ReplicaMessage(_message.Message):
    __slots__ = ("register", "pull", "heartbeat", "step", "hand_back")
    REGISTER_FIELD_NUMBER: _ClassVar[int]
    PULL_FIELD_NUMBER: _ClassVar[int]
    HEARTBEAT_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    HAND_BACK_FIELD_NUMBER: _ClassVar[int]
    register: Register
    pull: Pull
    heartbeat: Heartbeat
    step: StepOutputs
    hand_back: HandBack
    def __init__(self, register: _Optional[_Union[Register, _Mapping]] = ..., pull: _Optional[_Union[Pull, _Mapping]] = ..., heartbeat: _Optional[_Union[Heartbeat, _Mapping]] = ..., step: _Optional[_Union[StepOutputs, _Mapping]] = ..., hand_back: _Optional[_Union[HandBack, _Mapping]] = ...) -> None: ...

class Registered(_message.Message):
    __slots__ = ("heartbeat_interval_s", "lease_ttl_s", "policy", "keep_request_ids", "step_credit")
    HEARTBEAT_INTERVAL_S_FIELD_NUMBER: _ClassVar[int]
    LEASE_TTL_S_FIELD_NUMBER: _ClassVar[int]
    POLICY_FIELD_NUMBER: _ClassVar[int]
    KEEP_REQUEST_IDS_FIELD_NUMBER: _ClassVar[int]
    STEP_CREDIT_FIELD_NUMBER: _ClassVar[int]
    heartbeat_interval_s: float
    lease_ttl_s: float
    policy: str
    keep_request_ids: _containers.RepeatedScalarFieldContainer[str]
    step_credit: bool
    def __init__(self, heartbeat_interval_s: _Optional[float] = ..., lease_ttl_s: _Optional[float] = ..., policy: _Optional[str] = ..., keep_request_ids: _Optional[_Iterable[str]] = ..., step_credit: _Optional[bool] = ...) -> None: ...

class Assignment(_message.Message):
    __slots__ = ("request_id", "prompt_token_ids", "sampling", "resume_token_ids", "arrival_time", "resume_text_len", "stream_interval")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    RESUME_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    ARRIVAL_TIME_FIELD_NUMBER: _ClassVar[int]
    RESUME_TEXT_LEN_FIELD_NUMBER: _ClassVar[int]
    STREAM_INTERVAL_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    sampling: _generation_pb2.SamplingParams
    resume_token_ids: _containers.RepeatedScalarFieldContainer[int]
    arrival_time: float
    resume_text_len: int
    stream_interval: int
    def __init__(self, request_id: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., sampling: _Optional[_Union[_generation_pb2.SamplingParams, _Mapping]] = ..., resume_token_ids: _Optional[_Iterable[int]] = ..., arrival_time: _Optional[float] = ..., resume_text_len: _Optional[int] = ..., stream_interval: _Optional[int] = ...) -> None: ...

class Assign(_message.Message):
    __slots__ = ("assignments",)
    ASSIGNMENTS_FIELD_NUMBER: _ClassVar[int]
    assignments: _containers.RepeatedCompositeFieldContainer[Assignment]
    def __init__(self, assignments: _Optional[_Iterable[_Union[Assignment, _Mapping]]] = ...) -> None: ...

class CancelRequests(_message.Message):
    __slots__ = ("request_ids",)
    REQUEST_IDS_FIELD_NUMBER: _ClassVar[int]
    request_ids: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, request_ids: _Optional[_Iterable[str]] = ...) -> None: ...

class Drain(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class Ack(_message.Message):
    __slots__ = ("step_id",)
    STEP_ID_FIELD_NUMBER: _ClassVar[int]
    step_id: int
    def __init__(self, step_id: _Optional[int] = ...) -> None: ...

class RouterMessage(_message.Message):
    __slots__ = ("registered", "assign", "cancel", "drain", "ack")
    REGISTERED_FIELD_NUMBER: _ClassVar[int]
    ASSIGN_FIELD_NUMBER: _ClassVar[int]
    CANCEL_FIELD_NUMBER: _ClassVar[int]
    DRAIN_FIELD_NUMBER: _ClassVar[int]
    ACK_FIELD_NUMBER: _ClassVar[int]
    registered: Registered
    assign: Assign
    cancel: CancelRequests
    drain: Drain
    ack: Ack
    def __init__(self, registered: _Optional[_Union[Registered, _Mapping]] = ..., assign: _Optional[_Union[Assign, _Mapping]] = ..., cancel: _Optional[_Union[CancelRequests, _Mapping]] = ..., drain: _Optional[_Union[Drain, _Mapping]] = ..., ack: _Optional[_Union[Ack, _Mapping]] = ...) -> None: ...
