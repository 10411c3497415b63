"""What a request continued on another worker carries (cluster/serving/coordinator.py)."""

from __future__ import annotations

import pytest

from pdserve.cluster.serving.coordinator import _continuation, _transfer_failed
from pdserve.cluster.serving.errors import WorkerLost, WorkerUnavailable
from pdserve.cluster.serving.pools import Worker
from pdserve.cluster.serving.router import WorkerState
from pdserve.engine.messages import WorkerRequest
from pdserve.engine.sampling import SamplingParams
from pdserve.kv_transport import HandshakeRefused, PeerLost, PeerReplaced, SlowPathRefused, TransferTimeout


def test_the_streamed_tokens_join_the_prompt_and_leave_the_budget():
    req = WorkerRequest("r", (1, 2, 3), SamplingParams(temperature=0.0, max_tokens=10, stop_token_ids=(7,)))
    cont = _continuation(req, [4, 5], attempt=2)
    assert cont.prompt_token_ids == (1, 2, 3, 4, 5) and cont.params.max_tokens == 8
    assert cont.params.stop_token_ids == (7,) and cont.request_id == "r~2" != req.request_id
    assert cont.num_prior_output_tokens == 2  # a seeded request samples on from output index 2
    assert _continuation(cont, [6], attempt=3).num_prior_output_tokens == 3
    with pytest.raises(WorkerUnavailable):
        _continuation(req, list(range(10)), attempt=1)


@pytest.mark.parametrize("error, retried", [(PeerLost("x"), True), (TransferTimeout("x"), True),
                                            (PeerReplaced("x"), True), (HandshakeRefused("x"), False),
                                            (SlowPathRefused("x"), False)])
def test_only_transfer_failures_that_another_worker_may_not_have_are_retried(error, retried):
    worker = Worker("decode", None, WorkerState("decode-0"), None)
    failed = _transfer_failed(worker, error)
    assert isinstance(failed, WorkerUnavailable) and isinstance(failed, WorkerLost) == retried
