"""The sharded core of a token mixer: sequence-sharded streams in, the kernel on the whole sequence for this rank's
heads (or channels), sequence-sharded out.

Every sequential kernel of a hybrid model (a depthwise causal convolution, a Mamba / Mamba2 scan, a gated delta
rule) is independent across its heads or channels. Per kernel call, with ``P`` ranks in the SP group::

    streams [B, N/P, H, D]  --all-to-all-->  [B, N, h, D]   (all tokens, h = ceil(H/P) head slots)
                                               | one row per document (packed rows only)
                                               | the kernel, unchanged, on this rank's heads
    output  [B, N/P, H, D]  <--all-to-all--  [B, N, h, D]

Heads share grouped inputs as grouped-query attention shares keys and values (Mamba2's ``n_groups`` of B and C,
gated DeltaNet's key heads, Mamba's B and C shared by every channel): head ``i`` reads group ``i // (H / G)``. The
slots are laid out by :func:`~lightning_ulysses.heads.plan_heads` with the groups in the role of key/value heads,
so a head always sits next to its group, groups are replicated where ``G < P``, and head counts that do not divide
``P`` get inert slots whose outputs are dropped (no gradient reaches them).

Packed documents: a kernel that carries state along the sequence must start every document afresh. The streams
of a row of several documents are cut into one row per document (zero-padded at the end to the longest; causal
kernels never read the padding into a real token) and put back after the kernel, so any kernel, the torch
fallbacks included, computes each document exactly as if it ran alone. Each document's row costs up to the
longest document's length: ``num_documents * longest`` tokens per head slot, held only inside the kernel.
The index plan is built once per batch, before the first layer, from the documents the attention layers use
(:func:`plan_document_rows`; no host sync inside a layer).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed import ProcessGroup

from lightning_ulysses.attention import Documents, documents_of, heads_to_sequence, sequence_to_heads
from lightning_ulysses.heads import HeadLayout, plan_heads, select_heads


@dataclass(frozen=True)
class DocumentRows:
    """Cut ``[B, N, ...]`` whole rows into ``[D, L, ...]`` rows of one document each (``L`` the longest) and back."""

    to_rows: Tensor  # [D * L] flat token index, B * N (a zero row) past a document's end
    to_tokens: Tensor  # [B * N] flat row-slot index of every token
    num_documents: int
    longest: int

    @classmethod
    def of(cls, documents: Documents) -> "DocumentRows":
        device = documents.starts.device
        offsets = torch.tensor(documents.offsets, device=device)
        starts, lengths = offsets[:-1], offsets[1:] - offsets[:-1]
        total, count, longest = documents.starts.numel(), len(documents.offsets) - 1, documents.max_seqlen
        steps = torch.arange(longest, device=device)
        to_rows = torch.where(steps < lengths[:, None], starts[:, None] + steps, total).flatten()
        document = torch.repeat_interleave(torch.arange(count, device=device), lengths, output_size=total)
        to_tokens = document * longest + torch.arange(total, device=device) - starts[document]
        return cls(to_rows, to_tokens, count, longest)

    def split(self, x: Tensor) -> Tensor:
        """``[B, N, ...] -> [D, L, ...]``."""
        flat = x.flatten(0, 1)
        flat = torch.cat([flat, flat.new_zeros(1, *flat.shape[1:])])
        return flat.index_select(0, self.to_rows).unflatten(0, (self.num_documents, self.longest))

    def join(self, x: Tensor, batch: int) -> Tensor:
        """``[D, L, ...] -> [B, N, ...]``."""
        return x.flatten(0, 1).index_select(0, self.to_tokens).unflatten(0, (batch, -1))


def document_rows(documents: Documents | None) -> DocumentRows | None:
    """The rows of one document each of packed ``documents`` (built once, kept with them); ``None`` when every row
    is one document."""
    return None if documents is None or documents.one_per_row else documents.plan(DocumentRows, DocumentRows.of)


def plan_document_rows(position_ids: Tensor, group: ProcessGroup | None) -> None:
    """Find the documents of a batch and their :func:`document_rows` before the first layer (collective over
    ``group``; the one host sync of finding the documents), so that no mixer layer syncs."""
    document_rows(documents_of(position_ids, group))


class ShardedCore:
    """The all-to-alls and the document rows around one kernel call (see the module docstring).

    ``num_heads`` heads read ``num_groups`` groups (``num_groups == num_heads`` when nothing is shared).
    """

    def __init__(self, group: ProcessGroup, num_heads: int, num_groups: int, documents: Documents | None) -> None:
        self.group, self.rank, sp_size = group, dist.get_rank(group), dist.get_world_size(group)
        self.layout: HeadLayout = plan_heads(num_heads, num_groups, sp_size)
        self.rows = document_rows(documents)

    def _slots(self, grouped: bool) -> tuple[int, ...]:
        return self.layout.kv_slots if grouped else self.layout.query_slots

    def scatter(self, x: Tensor, grouped: bool = False) -> Tensor:
        """``[B, N/P, H or G, D]`` (this rank's tokens) -> ``[B', N', h, D]``: every token of this rank's slots, one
        row per document when the rows are packed."""
        x = sequence_to_heads(select_heads(x, self._slots(grouped)), self.group)
        return x if self.rows is None else self.rows.split(x)

    def gather(self, y: Tensor, batch: int) -> Tensor:
        """The inverse of :meth:`scatter` for a per-head output: ``[B', N', h, D] -> [B, N/P, H, D]``."""
        if self.rows is not None:
            y = self.rows.join(y, batch)
        return select_heads(heads_to_sequence(y, self.group), self.layout.output_slots)

    def gather_state(self, state: Tensor) -> Tensor | None:
        """A per-head recurrent state of this rank's slots ``[B, h, ...]`` -> ``[B, H, ...]``, every head's, detached
        (for a layer that returns its final state next to its output); ``None`` for rows cut into documents."""
        if self.rows is not None:
            return None
        states = [torch.empty_like(state) for _ in range(dist.get_world_size(self.group))]
        dist.all_gather(states, state.detach().contiguous(), group=self.group)
        return select_heads(torch.cat(states, dim=1), self.layout.output_slots, dim=1)

    def local(self, per_head: Tensor, grouped: bool = False) -> Tensor:
        """This rank's slots of a per-head (or per-group) parameter ``[H or G, ...]``, inert copies included."""
        per_rank = len(self._slots(grouped)) // dist.get_world_size(self.group)
        first = self.rank * per_rank
        return select_heads(per_head, self._slots(grouped)[first : first + per_rank], dim=0)
