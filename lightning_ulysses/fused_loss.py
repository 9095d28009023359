"""The tiled loss fused: each token tile's backward runs inside the forward, so no tile's logits are made twice.

The checkpointed tiles of :mod:`lightning_ulysses.logits` make every tile's ``[tile, V]`` logits twice per training
step: in the forward, and again in the backward, which recomputes them (one ``[tile, hidden] x [hidden, V]`` matmul,
the fp32 copy and the log-softmax: about 1 s of CPU per rank at 32k tokens of ``benchmarks.longest``'s model, sp=2).
:class:`FusedCrossEntropySum` runs, per tile, ``lm_head`` (called as the module it is, with the model's
:class:`~lightning_ulysses.logits.LogitMap`), the fp32 cross entropy and, at once, that tile's gradients with respect
to the hidden-state tile and ``lm_head``'s parameters (``torch.autograd.grad``): the hidden states' gradient is written
into one ``[tokens, hidden]`` buffer, the parameters' are summed over the tiles. Its backward only multiplies them by
the incoming gradient, a tensor op: no host sync, and no assumption that it is 1 (a loss scale, Lightning's
``1 / accumulate_grad_batches``, the SP gradient scale and any factor of the user's all pass through it exactly, unlike
DeepSpeed ALST's ``TiledFusedLogitsLoss``, which takes 1 for the weight and reads the gradient on the host, or Liger's
fused linear cross entropy, which reads it too). ``lm_head`` then runs once per tile and step, not twice.

Where it runs (:func:`engine_shards`, by what the parameters are):

* ``lm_head``'s parameters whole on the rank (plain PyTorch, DeepSpeed ZeRO 0, 1 and 2): fused. The parameters'
  gradients reach them through autograd as the model's own do (one accumulation per step, where ZeRO 1/2 hook
  their reduction); with tied embeddings they add to the input embedding's gradient there.
* ZeRO-3 (partitioned parameters, marked ``ds_id``) and FSDP2 (``fully_shard``: ``DTensor`` parameters, or an
  ``FSDPModule`` whose parameters are plain while gathered): the checkpointed tiles. These engines gather the
  parameters for each call and reduce their gradients from hooks in the model's backward, which a gradient made
  inside the forward would bypass.
* No gradient needed (evaluation, metrics, ``torch.no_grad``): the tiles' values alone, as without fusion
  (:func:`~lightning_ulysses.logits.fused_loss_sum` decides).

Its gradients are those of the hidden-state tile and ``lm_head``'s own parameters only: an ``lm_head`` whose forward
reads another tensor that needs a gradient (another module's weight not tied as the same ``Parameter``, a trainable
scale kept outside the module) would lose that tensor's gradient, so it is refused (:func:`unlisted_leaves` finds such
tensors in the graph). ``UlyssesStrategy`` refuses it at set-up, before any step, for the transformers models it checks
(:func:`~lightning_ulysses.hf.check.logits.check_tiled_logits` runs their ``lm_head`` once); the first tile of each
call refuses it too, for a head handed to the loss directly (``tiled_cross_entropy_sum``,
``UlyssesLossMixin.tiled_causal_lm_loss``), which nothing sees before the step.

Memory: the gradients of the hidden states (``[tokens, hidden]``, which the backward makes anyway) and of ``lm_head``'s
parameters exist from the loss's forward to its backward, which follows at once; a tile's transients are those of the
checkpointed tile's backward. The backward scales them in place and hands them on, so it runs once (a second backward
through the same graph, ``retain_graph=True``, is refused).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.autograd.function import FunctionCtx, once_differentiable
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

from lightning_ulysses.tiling import split_tiles


def engine_shards(module: nn.Module) -> bool:
    """Whether an engine shards ``module``'s parameters over the ranks: DeepSpeed ZeRO-3 (its partitioned parameters
    carry ``ds_id``, gathered or not) or FSDP2 (``DTensor`` parameters; a ``fully_shard`` ed module, whose parameters
    are plain tensors while gathered)."""
    return isinstance(module, FSDPModule) or any(
        hasattr(p, "ds_id") or isinstance(p, DTensor) for p in module.parameters()
    )


class FusedCrossEntropySum(torch.autograd.Function):
    """``sum over tokens of cross_entropy(head(hidden_states).float(), labels)``, fp32, with each tile's gradients made
    in the forward (see the module docstring).

    ``apply(head, num_tiles, ignore_index, hidden_states [tokens, hidden], labels [tokens], *parameters)``: ``head``
    maps ``[tile, hidden] -> [tile, V]`` with ``parameters`` (every tensor it reads that may need a gradient, other than
    its input), called exactly ``num_tiles`` times (tiles as :func:`~lightning_ulysses.tiling.split_tiles` cuts them,
    empty ones included).
    """

    @staticmethod
    def forward(
        ctx: FunctionCtx,
        head: Callable[[Tensor], Tensor],
        num_tiles: int,
        ignore_index: int,
        hidden_states: Tensor,
        labels: Tensor,
        *parameters: Tensor,
    ) -> Tensor:
        needs_grad: tuple[bool, ...] = ctx.needs_input_grad  # type: ignore[attr-defined]
        needs_hidden, needs_parameters = needs_grad[3], needs_grad[5:]
        trained = [p for p, needed in zip(parameters, needs_parameters, strict=True) if needed]
        hidden_states = hidden_states.detach()
        grad_hidden = torch.empty_like(hidden_states) if needs_hidden else None
        grad_parameters: list[Tensor | None] = [None] * len(trained)
        sums = []
        tiles = zip(
            split_tiles(hidden_states, num_tiles, dim=0),
            split_tiles(labels, num_tiles, dim=0),
            split_tiles(hidden_states if grad_hidden is None else grad_hidden, num_tiles, dim=0),
            strict=True,
        )
        for index, (hidden, target, grad_tile) in enumerate(tiles):
            hidden = hidden.detach().requires_grad_(needs_hidden)
            with torch.enable_grad():
                loss = F.cross_entropy(head(hidden).float(), target, ignore_index=ignore_index, reduction="sum")
            if index == 0:
                _refuse_unlisted_leaves(loss, [hidden, *parameters])
            _take_gradients(loss, hidden if needs_hidden else None, grad_tile, trained, grad_parameters)
            sums.append(loss.detach())
        gradients = iter(grad_parameters)
        ctx.gradients = (  # type: ignore[attr-defined]
            grad_hidden,
            [next(gradients) if needed else None for needed in needs_parameters],
            [p.dtype for p in parameters],
        )
        return torch.stack(sums).sum()

    @staticmethod
    @once_differentiable
    def backward(ctx: FunctionCtx, grad_loss: Tensor) -> tuple[Tensor | None, ...]:
        saved = ctx.gradients  # type: ignore[attr-defined]
        if saved is None:
            raise RuntimeError(
                "The fused tiled loss scales the gradients its forward made in place, so its backward runs once: a "
                "second backward through the same loss (retain_graph=True) is not supported."
            )
        ctx.gradients = None  # type: ignore[attr-defined]  # handed on below: AccumulateGrad may take them as they are
        grad_hidden, grad_parameters, dtypes = saved
        # grad_loss is a 0-dim tensor: multiplying by it never reads it on the host, whatever it is
        if grad_hidden is not None:
            grad_hidden.mul_(grad_loss)
        scaled = [None if g is None else g.mul_(grad_loss).to(dtype) for g, dtype in zip(grad_parameters, dtypes)]
        return None, None, None, grad_hidden, None, *scaled


def _take_gradients(
    loss: Tensor, hidden: Tensor | None, grad_tile: Tensor, trained: list[Tensor], sums: list[Tensor | None]
) -> None:
    """One tile's backward: ``loss``'s gradient with respect to ``hidden`` (written into ``grad_tile``) and to each
    of ``trained``, added to ``sums``. A function of its own so that the tile's gradients are freed on return, before
    the next tile makes its own (a ``[V, hidden]`` weight gradient each)."""
    inputs = [*([] if hidden is None else [hidden]), *trained]
    grads = list(torch.autograd.grad(loss, inputs, allow_unused=True))
    if hidden is not None:
        grad_tile.copy_(grads.pop(0))
    for i, grad in enumerate(grads):
        if grad is not None:
            sums[i] = _accumulate(sums[i], grad)


def _accumulate(total: Tensor | None, grad: Tensor) -> Tensor:
    """``total + grad``, in the parameter's dtype as autograd sums the gradients of a tensor used several times (the
    checkpointed tiles' path, whose results this one equals to rounding), but fp16's in fp32: that tile's gradient
    is taken at an incoming gradient of 1, not the loss's ``scale / tokens``, and the unscaled sum over a long shard's
    tokens can pass fp16's largest value (65504), which bf16 (fp32's exponent) cannot."""
    if total is None:
        return grad.float() if grad.dtype == torch.float16 else grad
    return total.add_(grad)


def unlisted_leaves(output: Tensor, listed_tensors: Sequence[Tensor]) -> list[Tensor]:
    """The tensors needing a gradient that ``output`` is computed from (the leaves of its graph) and that are none of
    ``listed_tensors``, each once: the gradients a backward taken with respect to ``listed_tensors`` alone would leave
    out. Walks ``output``'s graph once (a few nodes for a head's call)."""
    listed = {id(t) for t in listed_tensors}
    unlisted: dict[int, Tensor] = {}
    seen: set[Any] = set()
    pending = [output.grad_fn]
    while pending:
        node = pending.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        leaf = getattr(node, "variable", None)  # an AccumulateGrad node's tensor
        if leaf is not None and id(leaf) not in listed:
            unlisted[id(leaf)] = leaf
        pending.extend(next_node for next_node, _ in node.next_functions)
    return list(unlisted.values())


def _refuse_unlisted_leaves(loss: Tensor, listed_tensors: Sequence[Tensor]) -> None:
    """Raise where ``loss`` depends on a tensor needing a gradient that is none of ``listed_tensors`` (the tile and
    the head's parameters): the fused backward would drop its gradient. The strategy refuses such an ``lm_head`` of a
    transformers model at set-up; this refuses a head handed to the loss directly, at its first tile."""
    unlisted = unlisted_leaves(loss, listed_tensors)
    if unlisted:
        shapes = ", ".join(str(tuple(t.shape)) for t in unlisted)
        raise RuntimeError(
            f"lm_head's forward reads tensors shaped {shapes} that need a gradient and are none of its parameters: "
            "the fused tiled loss, which takes the gradients of lm_head's own parameters only, would leave theirs "
            "out. Pass the loss a head whose trainable tensors are its own parameters (make each a parameter of "
            "lm_head, or tie it as the same Parameter), or one that is not an nn.Module (the checkpointed tiles)."
        )
