"""The pdserve.v1.Admin gRPC service: the admin API's calls to `Elastic` (in a single server) or
to the control plane that runs it (`RemoteElastic`, in a frontend of a scaled-out one), its
errors to status codes. Its token is checked before a call gets here (`auth.AdminTokenInterceptor`)."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import grpc
from ray.exceptions import RayActorError

from pdserve.cluster.scaling.elastic import AdminRefused, Elastic
from pdserve.cluster.serving.errors import cause
from pdserve.cluster.serving.mirror import ControlPlaneLink, FrontendInfo
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


class ControlPlaneDown(Exception):
    """The control plane does not answer (UNAVAILABLE): elastic changes wait until it is back."""


class RemoteElastic:
    """`Elastic`'s calls, run by the control plane (`ControlPlane.admin`); the listing from the
    frontend's copy of its membership, so that it answers while the control plane is down."""

    def __init__(self, link: ControlPlaneLink) -> None:
        self.link = link

    def workers(self) -> list[WorkerInfo]:
        return [] if self.link.membership is None else list(self.link.membership.workers)

    async def refresh(self, timeout_s: float = 2.0) -> None:
        """The copy brought up to date when the control plane answers within `timeout_s` (a
        frontend's long poll learns of a worker change at once, of a frontend joining only at
        its next beat); else the listing is the cached one."""
        try:
            await asyncio.wait_for(self.link.refresh(), timeout_s)
        except Exception:  # noqa: BLE001 - down or restarting: the cache answers
            logger.info("control plane did not answer a listing: the cached membership answers")

    def frontends(self) -> list[FrontendInfo]:
        return [] if self.link.membership is None else list(self.link.membership.frontends)

    async def drain(self, worker_id: str, deadline_s: float | None, wait: bool) -> WorkerInfo:
        return await self._call("drain", worker_id, deadline_s, wait)

    async def add(self, role: str) -> WorkerInfo:
        return await self._call("add", role)

    async def remove(self, role: str, worker_id: str, deadline_s: float | None, wait: bool) -> WorkerInfo:
        return await self._call("remove", role, worker_id, deadline_s, wait)

    async def change_role(self, worker_id: str, role: str, deadline_s: float | None) -> tuple[WorkerInfo, WorkerInfo]:
        return await self._call("change_role", worker_id, role, deadline_s)

    async def _call(self, method: str, *args: Any) -> Any:
        try:
            result = await self.link.admin(method, *args)
        except RayActorError as e:
            raise ControlPlaneDown(f"the control plane is down ({type(e).__name__}): elastic changes wait until "
                                   "it is back") from e
        await self.link.refresh()  # this frontend's copy shows the change at once
        return result


async def _refuse(context: grpc.aio.ServicerContext, error: Exception) -> None:
    """The status an error of `Elastic` is to the caller; anything else propagates (INTERNAL)."""
    if isinstance(error, ControlPlaneDown):
        await context.abort(grpc.StatusCode.UNAVAILABLE, str(error))
    if isinstance(error, UnknownWorker):
        await context.abort(grpc.StatusCode.NOT_FOUND, str(error.args[0]))
    if isinstance(error, AdminRefused):
        await context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(error))
    await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(error))


def _frontend(f: FrontendInfo) -> pb.FrontendStatus:
    return pb.FrontendStatus(id=f.frontend_id, pid=f.pid, host=f.host, port=f.port, http_port=f.http_port,
                             metrics_port=f.metrics_port)


class AdminService(pb_grpc.AdminServicer):
    def __init__(self, elastic: Elastic | RemoteElastic) -> None:
        self.elastic = elastic

    async def ListWorkers(self, request: pb.ListWorkersRequest, context: grpc.aio.ServicerContext):  # noqa: N802
        frontends = []
        if isinstance(self.elastic, RemoteElastic):
            await self.elastic.refresh()
            frontends = self.elastic.frontends()
        return pb.ListWorkersResponse(workers=[_status(w) for w in self.elastic.workers()],
                                      frontends=[_frontend(f) for f in frontends])

    async def Drain(self, request: pb.DrainRequest, context: grpc.aio.ServicerContext):  # noqa: N802
        try:
            info = await self.elastic.drain(request.worker, _deadline(request), request.wait)
        except (UnknownWorker, AdminRefused, ValueError, ControlPlaneDown) as e:
            await _refuse(context, e)
        return pb.DrainResponse(worker=_status(info))

    async def AddWorker(self, request: pb.AddWorkerRequest, context: grpc.aio.ServicerContext):  # noqa: N802
        try:
            info = await self.elastic.add(request.role)
        except (ValueError, ControlPlaneDown) as e:
            await _refuse(context, e)
        except Exception as e:  # noqa: BLE001 - the actor did not start: its cause, the rest to the log
            logger.exception("admin: could not add a %s worker", request.role)
            await context.abort(grpc.StatusCode.UNAVAILABLE, f"could not start a {request.role} worker: {cause(e)}")
        return pb.AddWorkerResponse(worker=_status(info))

    async def RemoveWorker(self, request: pb.RemoveWorkerRequest, context: grpc.aio.ServicerContext):  # noqa: N802
        try:
            info = await self.elastic.remove(request.role, request.worker, _deadline(request), request.wait)
        except (UnknownWorker, AdminRefused, ValueError, ControlPlaneDown) as e:
            await _refuse(context, e)
        return pb.RemoveWorkerResponse(worker=_status(info))

    async def ChangeRole(self, request: pb.ChangeRoleRequest, context: grpc.aio.ServicerContext):  # noqa: N802
        try:
            drained, started = await self.elastic.change_role(request.worker, request.role, _deadline(request))
        except (UnknownWorker, AdminRefused, ValueError, ControlPlaneDown) as e:
            await _refuse(context, e)
        except Exception as e:  # noqa: BLE001 - the new actor did not start: its cause, the rest to the log
            logger.exception("admin: could not start the %s worker of a role change", request.role)
            await context.abort(grpc.StatusCode.UNAVAILABLE, f"the worker was drained, but no {request.role} worker "
                                                             f"started in its place: {cause(e)}")
        return pb.ChangeRoleResponse(drained=_status(drained), started=_status(started))
