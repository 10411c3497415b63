"""A test seam: a UCX sender that breaks its next transfers on purpose, as a broken peer would.

Failure tests need a transfer cut at a known point, in real processes over real UCX:
`UcxKVSender.inject(TransferFault(...))` (from a test, through a Ray actor call or a test
peer's command) makes that one sender's next `times` transfers over UCX messages fail
one way. Nothing is global and nothing is read from the environment: a sender without
one injected behaves as ever.
"""

from __future__ import annotations

from dataclasses import dataclass

# What the faulty sender does after it has announced a transfer (its "xfer" header, n blocks):
#   truncate  its data message carries only `after_blocks` blocks' worth of bytes, and it waits
#             for the receiver's verdict as ever (a peer whose payload disagrees with its header);
#   close     its link closes right after the header, silently (an endpoint made from a worker
#             address says nothing when it goes): the UCX endpoint closed mid-transfer;
#   stall     it never posts the data yet lives on, naming the request in its keep-alives, until
#             its own transfer timeout ends the send (a prefill side that fails to post its write).
FAULT_ACTIONS = ("truncate", "close", "stall")


@dataclass(frozen=True, slots=True)
class TransferFault:
    """How a sender breaks its next `times` transfers (UCX messages path; direct writes
    between GPUs are not cut). See FAULT_ACTIONS."""

    action: str
    after_blocks: int = 0
    times: int = 1

    def __post_init__(self) -> None:
        if self.action not in FAULT_ACTIONS:
            raise ValueError(f"TransferFault.action must be one of {FAULT_ACTIONS}, got {self.action!r}")
        if self.after_blocks < 0 or self.times < 1:
            raise ValueError(f"TransferFault: after_blocks >= 0 and times >= 1, got {self.after_blocks}, {self.times}")
        if self.action == "truncate" and self.after_blocks < 1:
            raise ValueError("TransferFault: truncate sends at least one block (after_blocks >= 1)")
