"""The pdserve.v1.Admin gRPC service: the admin API's calls to `Elastic`, its errors to status
codes. Its token is checked before a call gets here (`auth.AdminTokenInterceptor`)."""

from __future__ import annotations

import logging

import grpc

from pdserve.cluster.scaling.elastic import AdminRefused, Elastic
from pdserve.cluster.serving.errors import cause
from pdserve.cluster.serving.pools import Phase
from pdserve.cluster.serving.worker_set import UnknownWorker, WorkerInfo
from pdserve.proto.v1 import admin_pb2 as pb
from pdserve.proto.v1 import admin_pb2_grpc as pb_grpc

logger = logging.getLogger(__name__)

_PHASES = {Phase.SERVING: pb.WORKER_PHASE_SERVING, Phase.DRAINING: pb.WORKER_PHASE_DRAINING,
           Phase.GONE: pb.WORKER_PHASE_GONE}


def _status(info: WorkerInfo) -> pb.WorkerStatus:
    return pb.WorkerStatus(name=info.worker_id, role=info.role, phase=_PHASES[info.phase], running=info.num_running,
                           queued=info.num_queued, inflight=info.num_inflight)


def _deadline(request: pb.DrainRequest | pb.RemoveWorkerRequest | pb.ChangeRoleRequest) -> float | None:
    return request.deadline_s if request.HasField("deadline_s") else None


async def _refuse(context: grpc.aio.ServicerContext, error: Exception) -> None:
    """The status an error of `Elastic` is to the caller; anything else propagates (INTERNAL)."""
    if isinstance(error, UnknownWorker):
        await context.abort(grpc.StatusCode.NOT_FOUND, str(error.args[0]))
    if isinstance(error, AdminRefused):
        await context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(error))
    await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(error))


class AdminService(pb_grpc.AdminServicer):
    def __init__(self, elastic: Elastic) -> None:
        self.elastic = elastic

    async def ListWorkers(self, request: pb.ListWorkersRequest, context: grpc.aio.ServicerContext):  # noqa: N802
        return pb.ListWorkersResponse(workers=[_status(w) for w in self.elastic.workers()])

    async def Drain(self, request: pb.DrainRequest, context: grpc.aio.ServicerContext):  # noqa: N802
        try:
            info = await self.elastic.drain(request.worker, _deadline(request), request.wait)
        except (UnknownWorker, AdminRefused, ValueError) as e:
            await _refuse(context, e)
        return pb.DrainResponse(worker=_status(info))

    async def AddWorker(self, request: pb.AddWorkerRequest, context: grpc.aio.ServicerContext):  # noqa: N802
        try:
            info = await self.elastic.add(request.role)
        except ValueError as e:
            await _refuse(context, e)
        except Exception as e:  # noqa: BLE001 - the actor did not start: its cause, the rest to the log
            logger.exception("admin: could not add a %s worker", request.role)
            await context.abort(grpc.StatusCode.UNAVAILABLE, f"could not start a {request.role} worker: {cause(e)}")
        return pb.AddWorkerResponse(worker=_status(info))

    async def RemoveWorker(self, request: pb.RemoveWorkerRequest, context: grpc.aio.ServicerContext):  # noqa: N802
        try:
            info = await self.elastic.remove(request.role, request.worker, _deadline(request), request.wait)
        except (UnknownWorker, AdminRefused, ValueError) as e:
            await _refuse(context, e)
        return pb.RemoveWorkerResponse(worker=_status(info))

    async def ChangeRole(self, request: pb.ChangeRoleRequest, context: grpc.aio.ServicerContext):  # noqa: N802
        try:
            drained, started = await self.elastic.change_role(request.worker, request.role, _deadline(request))
        except (UnknownWorker, AdminRefused, ValueError) as e:
            await _refuse(context, e)
        except Exception as e:  # noqa: BLE001 - the new actor did not start: its cause, the rest to the log
            logger.exception("admin: could not start the %s worker of a role change", request.role)
            await context.abort(grpc.StatusCode.UNAVAILABLE, f"the worker was drained, but no {request.role} worker "
                                                             f"started in its place: {cause(e)}")
        return pb.ChangeRoleResponse(drained=_status(drained), started=_status(started))
