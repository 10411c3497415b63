"""A small synchronous client of pdserve.v1.Admin (`pdserve workers | drain | scale`)."""

from __future__ import annotations

from pdserve.cluster.clients.credentials import ClientCredentials
from pdserve.proto.v1 import admin_pb2 as pb
from pdserve.proto.v1 import admin_pb2_grpc as pb_grpc

PHASE_NAMES = {pb.WORKER_PHASE_SERVING: "serving", pb.WORKER_PHASE_DRAINING: "draining",
               pb.WORKER_PHASE_GONE: "gone"}


class AdminClient:
    """`credentials`: the TLS files, and the admin token as the bearer token (`admin_from_args`)."""

    def __init__(self, target: str, credentials: ClientCredentials | None = None) -> None:
        credentials = credentials or ClientCredentials()
        self.channel = credentials.grpc_channel(target)
        self._metadata = credentials.grpc_metadata()
        self.stub = pb_grpc.AdminStub(self.channel)

    def close(self) -> None:
        self.channel.close()

    def __enter__(self) -> AdminClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def workers(self, timeout_s: float = 10.0) -> list[pb.WorkerStatus]:
        return list(self.listing(timeout_s).workers)

    def listing(self, timeout_s: float = 10.0) -> pb.ListWorkersResponse:
        """The workers and (a scaled-out server's) the frontends."""
        return self.stub.ListWorkers(pb.ListWorkersRequest(), timeout=timeout_s, metadata=self._metadata)

    def drain(self, worker: str, deadline_s: float | None = None, wait: bool = False,
              timeout_s: float | None = None) -> pb.WorkerStatus:
        """`timeout_s`: the call's own bound (None: unbounded; with `wait`, a drain may take its deadline and more)."""
        req = pb.DrainRequest(worker=worker, wait=wait, deadline_s=deadline_s)
        return self.stub.Drain(req, timeout=timeout_s, metadata=self._metadata).worker

    def add_worker(self, role: str, timeout_s: float | None = None) -> pb.WorkerStatus:
        return self.stub.AddWorker(pb.AddWorkerRequest(role=role), timeout=timeout_s, metadata=self._metadata).worker

    def remove_worker(self, role: str, worker: str = "", deadline_s: float | None = None, wait: bool = False,
                      timeout_s: float | None = None) -> pb.WorkerStatus:
        req = pb.RemoveWorkerRequest(role=role, worker=worker, wait=wait, deadline_s=deadline_s)
        return self.stub.RemoveWorker(req, timeout=timeout_s, metadata=self._metadata).worker

    def change_role(self, worker: str, role: str, deadline_s: float | None = None,
                    timeout_s: float | None = None) -> tuple[pb.WorkerStatus, pb.WorkerStatus]:
        """(the drained worker, the one started in its place)."""
        req = pb.ChangeRoleRequest(worker=worker, role=role, deadline_s=deadline_s)
        resp = self.stub.ChangeRole(req, timeout=timeout_s, metadata=self._metadata)
        return resp.drained, resp.started
