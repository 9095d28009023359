"""The sharded core of a token mixer: sequence-sharded streams in, the kernel on the whole sequence for this rank's
heads (or channels), sequence-sharded out.

Every sequential kernel of a hybrid model (a depthwise causal convolution, a Mamba / Mamba2 scan, a gated delta
rule) is independent across its heads or channels. Per kernel call, with ``P`` ranks in the SP group::

    streams [B, N/P, H, D]  --all-to-all-->  [B, N, h, D]   (all tokens, h = ceil(H/P) head slots, sequence order)
                                               | one row per document (packed rows only)
                                               | the kernel, unchanged, on this rank's heads
    output  [B, N/P, H, D]  <--all-to-all--  [B, N, h, D]

Heads share grouped inputs as grouped-query attention shares keys and values (Mamba2's ``n_groups`` of B and C,
gated DeltaNet's key heads, Mamba's B and C shared by every channel): head ``i`` reads group ``i // (H / G)``. The
slots are laid out by :func:`~lightning_ulysses.heads.plan_heads` with the groups in the role of key/value heads,
so a head always sits next to its group, groups are replicated where ``G < P``, and head counts that do not divide
``P`` get inert slots whose outputs are dropped (no gradient reaches them).

Ulysses x Ring: the all-to-alls span the whole SP group (ring and Ulysses ranks), whose shards are the zigzag ones
of :func:`~lightning_ulysses.sharding.shard_index`; the gathered sequence is put back in sequence order before the
kernel and in shard order after it (:func:`~lightning_ulysses.attention.collectives.to_sequence_order`).

Packed documents: a kernel that carries state along the sequence must start every document afresh. The documents
of packed rows run as rows of their own, grouped in *length classes* as SDPA runs them
(:func:`~lightning_ulysses.attention.sdpa.plan_packed`, the same plan): each document padded at its end to its
class's length (less than 25% more), one kernel call ``[num_documents, length, h, D]`` per class, the outputs put
back in token order. A causal kernel never reads a document's padding into its real tokens and the padding's
outputs are dropped (no gradient), so any kernel, the torch fallbacks with their own chunk padding included,
computes each document exactly as if it ran alone, on fewer than ``1.25 N`` tokens per head slot whatever the mix
of lengths (a row of one long and many short documents included), in at most about ``4 log2(N)`` calls. The plan
is built once per batch, before the first layer, from the documents the attention layers use
(:func:`plan_document_rows`; no host sync inside a layer).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_ulysses.attention import Documents, documents_of, heads_to_sequence, sequence_to_heads
from lightning_ulysses.attention.collectives import gather_from_ranks, to_sequence_order, to_shard_order
from lightning_ulysses.attention.sdpa import PackedPlan, packed_plan, run_packed
from lightning_ulysses.groups import SequenceParallelGroups
from lightning_ulysses.heads import HeadLayout, plan_heads, select_heads

Kernel = Callable[..., tuple[Tensor, Any]]
"""A kernel on whole rows: ``[b, n, ...]`` streams -> ``([b, n, ...] output, final state or None)``."""


def document_rows(documents: Documents | None) -> PackedPlan | None:
    """The length classes of packed ``documents`` (built once, kept with them); ``None`` when every row is one
    document."""
    return None if documents is None or documents.one_per_row else packed_plan(documents)


def plan_document_rows(position_ids: Tensor, group: SequenceParallelGroups) -> None:
    """Find the documents of a batch and their :func:`document_rows` before the first layer (collective over
    ``group``; the one host sync of finding the documents), so that no mixer layer syncs."""
    document_rows(documents_of(position_ids, group))


class ShardedCore:
    """The all-to-alls and the document rows around one kernel call (see the module docstring).

    ``num_heads`` heads read ``num_groups`` groups (``num_groups == num_heads`` when nothing is shared); ``group``:
    the SP groups (their all-to-alls reported to their observer, their shards in zigzag order under a ring).
    """

    def __init__(
        self, group: SequenceParallelGroups, num_heads: int, num_groups: int, documents: Documents | None
    ) -> None:
        self.group, self.process_group, self.observer = group, group.sp, group.observer
        self.rank, sp_size = dist.get_rank(self.process_group), dist.get_world_size(self.process_group)
        self.layout: HeadLayout = plan_heads(num_heads, num_groups, sp_size)
        self.rows = document_rows(documents)

    def _slots(self, grouped: bool) -> tuple[int, ...]:
        return self.layout.kv_slots if grouped else self.layout.query_slots

    def scatter(self, x: Tensor, grouped: bool = False) -> Tensor:
        """``[B, N/P, H or G, D]`` (this rank's tokens) -> ``[B, N, h, D]``: every token of this rank's slots, in
        sequence order."""
        (x,) = sequence_to_heads(
            select_heads(x, self._slots(grouped)), group=self.process_group, observer=self.observer
        )
        return to_sequence_order(x, self.group)

    def run(self, kernel: Kernel, *streams: Tensor) -> tuple[Tensor, Any]:
        """``kernel`` on scattered ``[B, N, ...]`` streams: ``(output [B, N, ...], final state)``. Packed rows run
        one call per length class, each document a row of its own; their state (per document) is ``None``."""
        if self.rows is None:
            return kernel(*streams)
        batch, seq_len = streams[0].shape[:2]
        (output,) = run_packed(self.rows, streams, lambda *rows: kernel(*rows)[:1])
        return output.unflatten(0, (batch, seq_len)), None

    def gather(self, y: Tensor) -> Tensor:
        """The inverse of :meth:`scatter` for a per-head output: ``[B, N, h, D] -> [B, N/P, H, D]``."""
        y = heads_to_sequence(to_shard_order(y, self.group), self.process_group, self.observer)
        return select_heads(y, self.layout.output_slots)

    def gather_state(self, state: Tensor) -> Tensor:
        """A per-head recurrent state of this rank's slots ``[B, h, ...]`` -> ``[B, H, ...]``, every head's, detached
        (for a layer that returns its final state next to its output)."""
        states = gather_from_ranks(state.detach(), self.process_group)
        return select_heads(torch.cat(states, dim=1), self.layout.output_slots, dim=1)

    def local(self, per_head: Tensor, grouped: bool = False) -> Tensor:
        """This rank's slots of a per-head (or per-group) parameter ``[H or G, ...]``, inert copies included: a view
        of it when they are consecutive heads (no copy of the weight for autograd to keep)."""
        per_rank = len(self._slots(grouped)) // dist.get_world_size(self.process_group)
        slots = self._slots(grouped)[self.rank * per_rank : (self.rank + 1) * per_rank]
        if slots == tuple(range(slots[0], slots[0] + per_rank)):  # a view: the kernel's backward keeps no weight copy
            return per_head.narrow(0, slots[0], per_rank)
        return select_heads(per_head, slots, dim=0)
