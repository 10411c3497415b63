"""One writer of a sequence's state: production code writes a `Sequence` field only in the
scheduler (`engine/scheduler.py`: a target's sequences, and through its `shadow_*` functions,
which the drafter calls, the draft model's shadow sequences), and the block manager its block
fields. Checked on the source's syntax trees: an assignment, augmented assignment or `del` of
such a field (or of an item or slice of it), or a mutating call on it (`append`, `extend`,
...), is a write.

A write is recognised by the field's name on anything but `self`: other classes have fields of
the same names (a delta's `token_ids`), and a sequence is never `self` outside its own class.
The few other objects written under such a name from outside are listed in WRITERS by file.

And one owner of each of the cluster's two seams: the coordinator (`cluster/serving/coordinator.py`:
requests' attempts) and the worker set (`cluster/serving/worker_set.py`: pools, seats, token
streams, KV index). From any other production module they are spoken to through their public
methods only: an attribute chain through an object named for one of them
(`x.coordinator.streams`, `worker_set.kv_index`, `self._coordinator.seats`) that reaches
anything else (a part, a field, a private method) is a reach into its parts.
"""

from __future__ import annotations

import ast
import dataclasses
from pathlib import Path

from pdserve.cluster.serving.coordinator import Coordinator
from pdserve.cluster.serving.worker_set import WorkerSet
from pdserve.engine.sequence import Sequence

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("cluster", "decode_node", "engine", "kernels", "kv_transport", "prefill_node", "proto")
FIELDS = {f.name for f in dataclasses.fields(Sequence)} - {"request_id", "prompt_token_ids", "params", "block_size"}
BLOCK_FIELDS = {"block_ids", "block_table_version", "num_cached_tokens", "num_published_blocks"}
MUTATORS = {"append", "extend", "insert", "pop", "remove", "clear", "sort", "reverse", "update", "add", "discard"}
WRITERS = {
    "engine/scheduler.py": FIELDS,
    "engine/kv/block_manager.py": BLOCK_FIELDS,
    "engine/sequence.py": FIELDS,  # its own methods (`self`) and construction
    "cluster/api/grpc_service.py": {"finish_reason"},  # a gRPC response's
}


def _field_written(node: ast.expr) -> ast.Attribute | None:
    """`x.field`, `x.field[i]` or `x.field[a:b]` with a sequence field, x not `self`."""
    while isinstance(node, ast.Subscript):
        node = node.value
    if isinstance(node, ast.Attribute) and node.attr in FIELDS:
        if not (isinstance(node.value, ast.Name) and node.value.id == "self"):
            return node
    return None


def sequence_writes(source: str) -> list[tuple[int, str]]:
    """(line, field) of each write to a sequence field in `source`."""
    writes = []
    for node in ast.walk(ast.parse(source)):
        targets: list[ast.expr] = []
        if isinstance(node, (ast.Assign, ast.Delete)):
            targets = list(node.targets)
        elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
            targets = [node.target]
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in MUTATORS:
            targets = [node.func.value]
        for target in targets:
            for one in (target.elts if isinstance(target, ast.Tuple) else [target]):
                attr = _field_written(one)
                if attr is not None:
                    writes.append((node.lineno, attr.attr))
    return sorted(writes)


def test_the_check_sees_every_kind_of_write():
    source = """
seq.num_computed_tokens = 3
seq.num_computed_tokens += 1
seq.status, other = 1, 2
del seq.token_ids[4:]
seq.token_ids[0] = 7
seq.spec_token_ids.append(1)
shadows[i].token_ids.extend(ids)
self.seq.finish_reason = None
self.token_ids = []          # another class's own field
delta.token_ids_count = 1    # not a sequence field
n = seq.num_tokens           # a read
"""
    assert [line for line, _ in sequence_writes(source)] == [2, 3, 4, 5, 6, 7, 8, 9]


def test_production_code_writes_a_sequence_only_in_the_scheduler():
    found: list[str] = []
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            name, source = path.relative_to(ROOT).as_posix(), path.read_text()
            allowed = WRITERS.get(name, set())
            found += [f"{name}:{line}: {field}" for line, field in sequence_writes(source) if field not in allowed]
    assert not found, "a sequence written outside the scheduler:\n" + "\n".join(found)


def _methods(cls: type) -> set[str]:
    """A class's public interface: its public methods and properties (not its parts)."""
    return {name for name, value in vars(cls).items()
            if not name.startswith("_") and (callable(value) or isinstance(value, property))}


# Owner -> (its module, the names it is spoken to through). A name for it: `coordinator`,
# `worker_set`, with or without a leading underscore.
OWNERS = {
    "coordinator": ("cluster/serving/coordinator.py", _methods(Coordinator)),
    # Not `pools()`: the Pool objects themselves, for its own loops and for the tests' eyes; no
    # call across the seam hands out an object graph.
    "worker_set": ("cluster/serving/worker_set.py", _methods(WorkerSet) - {"pools"}),
}


def reaches_into_owners(source: str, owners: dict[str, set[str]]) -> list[tuple[int, str]]:
    """(line, chain) of each `<...>.owner.part` or `owner.part` in `source` whose part is not
    one of `owners[owner]`, the owner named `owner` or `_owner`."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.Attribute):
            continue
        holder = node.value
        name = holder.attr if isinstance(holder, ast.Attribute) else holder.id if isinstance(holder, ast.Name) else None
        owner = None if name is None else name.lstrip("_")
        if owner in owners and node.attr not in owners[owner]:
            found.append((node.lineno, f"{ast.unparse(node)}"))
    return sorted(found)


def test_the_owner_check_sees_every_reach_into_a_part():
    owners = {"coordinator": {"generate", "capacity", "mode"}, "worker_set": {"workers", "add"}}
    source = """
self.coordinator.streams.follow(worker)
coordinator.seats.num_queued
self.frontend.coordinator.kv_index.blocks_of(w)
x = self._worker_set.decode
worker_set.seats.wake()
self.coordinator._abort(w, rid)
srv.server.coordinator.pools()
self.coordinator.generate(req)     # its interface
n = self.coordinator.capacity()
self.worker_set.workers()
await worker_set.add(role)
self.coordinator = coordinator     # holding it is not reaching into it
coordinators.seats                 # another name
"""
    assert [line for line, _ in reaches_into_owners(source, owners)] == [2, 3, 4, 5, 6, 7, 8]


def test_production_code_reaches_no_owners_parts():
    found: list[str] = []
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            name, source = path.relative_to(ROOT).as_posix(), path.read_text()
            owners = {owner: methods for owner, (module, methods) in OWNERS.items() if module != name}
            found += [f"{name}:{line}: {chain}" for line, chain in reaches_into_owners(source, owners)]
    assert not found, "a reach into the coordinator's or the worker set's parts:\n" + "\n".join(found)
