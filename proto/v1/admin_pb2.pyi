from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class WorkerPhase(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    WORKER_PHASE_UNSPECIFIED: _ClassVar[WorkerPhase]
    WORKER_PHASE_SERVING: _ClassVar[WorkerPhase]
    WORKER_PHASE_DRAINING: _ClassVar[WorkerPhase]
    WORKER_PHASE_GONE: _ClassVar[WorkerPhase]
WORKER_PHASE_UNSPECIFIED: WorkerPhase
WORKER_PHASE_SERVING: WorkerPhase
WORKER_PHASE_DRAINING: WorkerPhase
WORKER_PHASE_GONE: WorkerPhase

class WorkerStatus(_message.Message):
    __slots__ = ("name", "role", "phase", "running", "queued", "inflight")
    NAME_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    PHASE_FIELD_NUMBER: _ClassVar[int]
    RUNNING_FIELD_NUMBER: _ClassVar[int]
    QUEUED_FIELD_NUMBER: _ClassVar[int]
    INFLIGHT_FIELD_NUMBER: _ClassVar[int]
    name: str
    role: str
    phase: WorkerPhase
    running: int
    queued: int
    inflight: int
    def __init__(self, name: _Optional[str] = ..., role: _Optional[str] = ..., phase: _Optional[_Union[WorkerPhase, str]] = ..., running: _Optional[int] = ..., queued: _Optional[int] = ..., inflight: _Optional[int] = ...) -> None: ...

class ListWorkersRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class FrontendStatus(_message.Message):
    __slots__ = ("id", "pid", "host", "port", "http_port", "metrics_port")
    ID_FIELD_NUMBER: _ClassVar[int]
    PID_FIELD_NUMBER: _ClassVar[int]
    HOST_FIELD_NUMBER: _ClassVar[int]
    PORT_FIELD_NUMBER: _ClassVar[int]
    HTTP_PORT_FIELD_NUMBER: _ClassVar[int]
    METRICS_PORT_FIELD_NUMBER: _ClassVar[int]
    id: str
    pid: int
    host: str
    port: int
    http_port: int
    metrics_port: int
    def __init__(self, id: _Optional[str] = ..., pid: _Optional[int] = ..., host: _Optional[str] = ..., port: _Optional[int] = ..., http_port: _Optional[int] = ..., metrics_port: _Optional[int] = ...) -> None: ...

class ListWorkersResponse(_message.Message):
    __slots__ = ("workers", "frontends")
    WORKERS_FIELD_NUMBER: _ClassVar[int]
    FRONTENDS_FIELD_NUMBER: _ClassVar[int]
    workers: _containers.RepeatedCompositeFieldContainer[WorkerStatus]
    frontends: _containers.RepeatedCompositeFieldContainer[FrontendStatus]
    def __init__(self, workers: _Optional[_Iterable[_Union[WorkerStatus, _Mapping]]] = ..., frontends: _Optional[_Iterable[_Union[FrontendStatus, _Mapping]]] = ...) -> None: ...

class DrainRequest(_message.Message):
    __slots__ = ("worker", "deadline_s", "wait")
    WORKER_FIELD_NUMBER: _ClassVar[int]
    DEADLINE_S_FIELD_NUMBER: _ClassVar[int]
    WAIT_FIELD_NUMBER: _ClassVar[int]
    worker: str
    deadline_s: float
    wait: bool
    def __init__(self, worker: _Optional[str] = ..., deadline_s: _Optional[float] = ..., wait: _Optional[bool] = ...) -> None: ...

class DrainResponse(_message.Message):
    __slots__ = ("worker",)
    WORKER_FIELD_NUMBER: _ClassVar[int]
    worker: WorkerStatus
    def __init__(self, worker: _Optional[_Union[WorkerStatus, _Mapping]] = ...) -> None: ...

class AddWorkerRequest(_message.Message):
    __slots__ = ("role",)
    ROLE_FIELD_NUMBER: _ClassVar[int]
    role: str
    def __init__(self, role: _Optional[str] = ...) -> None: ...

class AddWorkerResponse(_message.Message):
    __slots__ = ("worker",)
    WORKER_FIELD_NUMBER: _ClassVar[int]
    worker: WorkerStatus
    def __init__(self, worker: _Optional[_Union[WorkerStatus, _Mapping]] = ...) -> None: ...

class RemoveWorkerRequest(_message.Message):
    __slots__ = ("role", "worker", "deadline_s", "wait")
    ROLE_FIELD_NUMBER: _ClassVar[int]
    WORKER_FIELD_NUMBER: _ClassVar[int]
    DEADLINE_S_FIELD_NUMBER: _ClassVar[int]
    WAIT_FIELD_NUMBER: _ClassVar[int]
    role: str
    worker: str
    deadline_s: float
    wait: bool
    def __init__(self, role: _Optional[str] = ..., worker: _Optional[str] = ..., deadline_s: _Optional[float] = ..., wait: _Optional[bool] = ...) -> None: ...

class RemoveWorkerResponse(_message.Message):
    __slots__ = ("worker",)
    WORKER_FIELD_NUMBER: _ClassVar[int]
    worker: WorkerStatus
    def __init__(self, worker: _Optional[_Union[WorkerStatus, _Mapping]] = ...) -> None: ...

class ChangeRoleRequest(_message.Message):
    __slots__ = ("worker", "role", "deadline_s")
    WORKER_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    DEADLINE_S_FIELD_NUMBER: _ClassVar[int]
    worker: str
    role: str
    deadline_s: float
    def __init__(self, worker: _Optional[str] = ..., role: _Optional[str] = ..., deadline_s: _Optional[float] = ...) -> None: ...

class ChangeRoleResponse(_message.Message):
    __slots__ = ("drained", "started")
    DRAINED_FIELD_NUMBER: _ClassVar[int]
    STARTED_FIELD_NUMBER: _ClassVar[int]
    drained: WorkerStatus
    started: WorkerStatus
    def __init__(self, drained: _Optional[_Union[WorkerStatus, _Mapping]] = ..., started: _Optional[_Union[WorkerStatus, _Mapping]] = ...) -> None: ...
