"""What the scheduler side tells the workers each step (pickled with vLLM's SchedulerOutput).

Block id lists are per KV-cache group; ``SKIP`` marks a block of a chunk that the worker must
leave alone (it is already computed locally).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvd import _native

#: A block id in a retrieve that kvd leaves untouched.
SKIP: int = _native.SKIP

#: (chunk hash, block ids of the chunk) for one group.
Chunk = tuple[int, list[int]]


@dataclass
class LoadOp:
    """Retrieve a request's hit chunks into its freshly allocated blocks."""

    req_id: str
    salt: int
    #: Per group: (the lookup's pin ids, one per registration of the group; chunks).
    groups: list[tuple[list[int], list[Chunk]]]
    #: The hit cannot be placed (vLLM gave a state no block): the workers fail the load at once,
    #: so vLLM recomputes it.
    invalid: bool = False
    #: vLLM scheduled the request in this step with the hit counted as computed: the step's
    #: forward pass must wait for the copy (a failure is reported as blocks to recompute).
    sync: bool = False
    #: kvd's copy waits for the model's stream (an event recorded there) before it starts: some
    #: block of the load may still be in use by a forward pass on the GPU (``KvdConfig.load_overlap``).
    wait: bool = True


@dataclass
class StoreOp:
    """Store chunks a step's forward pass has just computed."""

    req_id: str
    salt: int
    #: Per group: chunks (empty for groups this rank does not store, e.g. MLA on rank > 0).
    groups: list[list[Chunk]]
    #: Index in the request of the first chunk of every group's list (KV events need it).
    first_chunk: int = 0


@dataclass
class KvdMetadata:
    loads: list[LoadOp] = field(default_factory=list)
    stores: list[StoreOp] = field(default_factory=list)
    #: Finished requests whose block frees wait for their stores (request_finished said so);
    #: each worker reports them as finished sending once its own stores for them are done.
    delayed: list[str] = field(default_factory=list)
    #: Requests preempted this step: their blocks may be reused, so pending stores must be
    #: ordered before the next forward.
    preempted: list[str] = field(default_factory=list)

    def is_empty(self) -> bool:
        return not (self.loads or self.stores or self.delayed or self.preempted)
