"""Pure pieces: config validation, layout fingerprint, secret proofs, transport detection."""

from __future__ import annotations

import pytest
import torch

from pdserve.engine.kv.pool import KVLayout
from pdserve.kv_transport import TransportConfig
from pdserve.kv_transport.handshake import (
    HELLO_TAG,
    check_proof,
    control_tags,
    data_tag,
    describe_mismatch,
    fingerprint,
    layout_fields,
    new_connection_id,
    prove,
    prove_address,
    prove_hello,
)
from pdserve.kv_transport.transport_info import classify_tl, transport_from_ep_info

SECRET = b"0123456789abcdef"
LAYOUT = KVLayout("llama", torch.bfloat16, num_layers=32, num_kv_heads=8, head_dim=128, block_size=16)


@pytest.mark.parametrize(
    "kwargs",
    [
        {"secret": b"short"},
        {"secret": SECRET, "listen_host": ""},
        {"secret": SECRET, "transfer_timeout_s": 0},
        {"secret": SECRET, "connect_timeout_s": -1},
        {"secret": SECRET, "allowed_transports": []},
        {"secret": SECRET, "allowed_transports": ["nvlink"]},
        {"secret": SECRET, "progress_mode": "busy"},
        {"secret": SECRET, "progress_wake_ms": 0},
    ],
)
def test_config_rejects_bad_values(kwargs: dict[str, object]) -> None:
    with pytest.raises(ValueError):
        TransportConfig(**kwargs)  # type: ignore[arg-type]


def test_config_normalises_allowed_transports_and_hides_secret() -> None:
    config = TransportConfig(secret=SECRET, allowed_transports=["cuda_ipc", "rdma"])  # type: ignore[arg-type]
    assert config.allowed_transports == frozenset({"cuda_ipc", "rdma"})
    assert "0123" not in repr(config)


def test_unknown_transport_passes_only_without_restrictions() -> None:
    assert TransportConfig(secret=SECRET).allows("unknown")
    strict = TransportConfig(secret=SECRET, allowed_transports=frozenset({"cuda_ipc", "rdma"}))
    assert strict.allows("rdma") and not strict.allows("tcp") and not strict.allows("unknown")


def test_fingerprint_covers_every_layout_field() -> None:
    base = fingerprint(layout_fields(LAYOUT))
    variants = [
        KVLayout("qwen", torch.bfloat16, 32, 8, 128, 16),
        KVLayout("llama", torch.float16, 32, 8, 128, 16),
        KVLayout("llama", torch.float8_e4m3fn, 32, 8, 128, 16),  # an FP8 pool beside a bf16 one
        KVLayout("llama", torch.bfloat16, 16, 8, 128, 16),
        KVLayout("llama", torch.bfloat16, 32, 4, 128, 16),
        KVLayout("llama", torch.bfloat16, 32, 8, 64, 16),
        KVLayout("llama", torch.bfloat16, 32, 8, 128, 32),
        KVLayout("llama", torch.bfloat16, 32, 1, 128, 16, kind="mla"),  # a latent beside one KV head of its width
        KVLayout("llama", torch.bfloat16, 32, 1, 128, 16),
    ]
    assert len({base, *(fingerprint(layout_fields(v)) for v in variants)}) == 1 + len(variants)
    assert fingerprint(layout_fields(LAYOUT)) == base


def test_describe_mismatch_names_the_fields() -> None:
    ours = layout_fields(LAYOUT)
    theirs = layout_fields(KVLayout("llama", torch.float16, 32, 8, 64, 16))
    assert describe_mismatch(ours, ours) == ""
    assert describe_mismatch(ours, theirs) == "dtype: ours 'bfloat16', peer 'float16'; head_dim: ours 128, peer 64"


def test_proofs_bind_secret_role_nonces_and_layout() -> None:
    fp = fingerprint(layout_fields(LAYOUT))
    a, b = b"a" * 16, b"b" * 16
    proof = prove(SECRET, "server", a, b, fp)
    assert check_proof(SECRET, "server", a, b, fp, proof)
    assert not check_proof(b"another-secret-16", "server", a, b, fp, proof)
    assert not check_proof(SECRET, "client", a, b, fp, proof)  # a server proof is no client proof
    assert not check_proof(SECRET, "server", b, a, fp, proof)  # nor valid in another session
    assert not check_proof(SECRET, "server", a, b, "0" * 64, proof)


def test_data_tags_differ_per_session_and_request() -> None:
    tags = {data_tag(s, r) for s in (b"s1" * 16, b"s2" * 16) for r in ("req-1", "req-2")}
    assert len(tags) == 4 and all(0 <= t < 2**64 for t in tags)


@pytest.mark.parametrize(
    ("tl", "cls"),
    [("cuda_ipc", "cuda_ipc"), ("rc_mlx5", "rdma"), ("dc_mlx5", "rdma"), ("posix", "shm"), ("cma", "shm"),
     ("tcp", "tcp"), ("cuda_copy", None), ("self", None)],
)
def test_classify_tl(tl: str, cls: str | None) -> None:
    assert classify_tl(tl) == cls


# Trimmed from ucp_ep_print_info on the CPU machine (UCX 1.21).
_TCP_INFO = """#
#                 lane[0]: cm tcp
#                 lane[1]:  2:tcp/lo.0 md[1]                -> md[1]/tcp/sysdev[255] seg 4294967295 rma_bw#0 am wireup
#                 lane[2]:  1:tcp/eth0.0 md[1]              -> md[1]/tcp/sysdev[255] seg 4294967295 rma_bw#1
# | ucp_context_0 intra-node cfg#3 | tagged message by ucp_tag_send* from host memory    |
# |                              0 | eager short                                | tcp/lo |
# |                     16353..inf | (?) rendezvous fragmented copy-in copy-out | tcp/lo |
"""
_SHM_INFO = """#
#                 lane[0]:  3:sysv/memory.0 md[2]           -> md[2]/sysv/sysdev[255] seg 4294967295 am
#                 lane[2]:  5:cma/memory.0 md[4]            -> md[4]/cma/sysdev[255] seg 4294967295 rma_bw#0
# | ucp_context_0 intra-node cfg#0 | tagged message by ucp_tag_send* from host memory        |
# |                        0..2039 | eager short                               | sysv/memory |
# |                        8K..inf | (?) rendezvous zero-copy read from remote | cma/memory  |
"""
_CUDA_PIPELINE = """#
# | ucp_context_0 intra-node cfg#1 | tagged message by ucp_tag_send* from cuda/GPU0 memory |
# |    16353..inf | (?) rendezvous pipeline cuda_copy, fragmented copy-in copy-out | cuda_copy/cuda, tcp/lo |
"""
_CUDA_LANES_ONLY = """#
#                 lane[0]:  4:cuda_ipc/cuda.0 md[5]  -> md[5]/cuda_ipc/sysdev[0] seg 0 rma_bw#0
#                 lane[1]:  3:sysv/memory.0 md[2]    -> md[2]/sysv/sysdev[255] seg 4294967295 am
"""


@pytest.mark.parametrize(
    ("info", "memory", "expected"),
    [(_TCP_INFO, "host", "tcp"), (_SHM_INFO, "host", "shm"), (_CUDA_LANES_ONLY, "cuda", "cuda_ipc"),
     (_SHM_INFO, "cuda", "shm"), (_CUDA_PIPELINE, "cuda", "tcp"), (_CUDA_PIPELINE + _SHM_INFO, "host", "shm"),
     ("", "host", "unknown")],
)
def test_transport_from_ep_info(info: str, memory: str, expected: str) -> None:
    assert transport_from_ep_info(info, memory) == expected


def test_connections_have_tags_of_their_own_and_hellos_a_proof() -> None:
    a, b = new_connection_id(), new_connection_id()
    assert a != b and len({HELLO_TAG, *control_tags(a), *control_tags(b)}) == 5
    fp, nonce, address = fingerprint(layout_fields(LAYOUT)), b"n" * 16, b"worker address"
    other_secret = b"another-secret-of-16"
    proof = prove_hello(SECRET, nonce, a, 0, address, fp)
    assert proof not in {prove_hello(SECRET, nonce, b, 0, address, fp), prove_hello(SECRET, nonce, a, 0, b"other", fp),
                         prove_hello(SECRET, nonce, a, 2, address, fp),
                         prove_hello(other_secret, nonce, a, 0, address, fp)}
    assert prove_address(SECRET, address) != prove_address(other_secret, address)
