"""Tiled logits give the values of the whole logits without ever building them.

Every consumer (the loss sum, ``TokenCrossEntropy``, ``Perplexity``, ``TokenAccuracy``, ``token_log_probs``) is
run on :class:`TiledLogits` and on the whole ``[B, n, V]`` logits of the same ``lm_head`` and must agree to
``rtol=1e-5``, with tile counts that do not divide the tokens and tiles left empty. Memory is checked op by
op: a dispatch mode records the largest tensor any operation creates (forward and backward); with tiles it
must stay at one tile's ``[tile_tokens, V]``, and the untiled computation must reach ``[tokens, V]``
(which shows the check sees the buffer it is looking for).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import pytest
import torch
from torch import Tensor
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from lightning_ulysses.logits import (
    CROSS_ENTROPY_BYTES_PER_LOGIT,
    Logits,
    TiledLogits,
    loss_tile_tokens,
    resolve_loss_tiles,
)
from lightning_ulysses.loss import UlyssesLossMixin, token_cross_entropy
from lightning_ulysses.metrics import Perplexity, TokenAccuracy, TokenCrossEntropy
from lightning_ulysses.prediction import token_log_probs
from lightning_ulysses.sharding import IGNORE_INDEX
from lightning_ulysses.tiling import split_tiles, tiled_map


class LargestTensor(TorchDispatchMode):
    """Records the element count of the largest tensor that any operation returns while active."""

    def __init__(self) -> None:
        super().__init__()
        self.numel = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        sizes = [t.numel() for t in tree_leaves(out) if isinstance(t, Tensor)]
        self.numel = max([self.numel, *sizes])
        return out


def _inputs(tokens: int = 37, hidden: int = 16, vocab: int = 101) -> tuple[Tensor, torch.nn.Linear, Tensor]:
    torch.manual_seed(0)
    lm_head = torch.nn.Linear(hidden, vocab, bias=False)
    hidden_states = torch.randn(1, tokens, hidden)
    labels = torch.randint(0, vocab, (1, tokens))
    labels[0, 3:9] = IGNORE_INDEX
    return hidden_states, lm_head, labels


@pytest.mark.parametrize("num_tiles", [1, 4, 50])  # 37 tokens: 4 tiles do not divide them, 50 leave 13 empty
def test_tiled_values_equal_whole_logits(num_tiles: int) -> None:
    hidden_states, lm_head, labels = _inputs()
    # a 2-row batch, so that [B, n] shapes are restored in order
    hidden_states, labels = hidden_states.view(1, 37, 16).expand(2, -1, -1).contiguous(), labels.expand(2, -1).clone()
    hidden_states[1] += 0.5
    labels[1, :5] = IGNORE_INDEX
    tiled = TiledLogits(hidden_states, lm_head, num_tiles)
    with torch.no_grad():
        whole = lm_head(hidden_states)
        for metric_class in (TokenCrossEntropy, Perplexity, TokenAccuracy):
            expected, got = metric_class(), metric_class()
            expected.update(whole, labels)
            got.update(tiled, labels)
            assert expected.count == got.count > 0
            torch.testing.assert_close(got.compute(), expected.compute(), rtol=1e-5, atol=0)
        expected_log_probs = token_log_probs(whole, labels)
        got_log_probs = token_log_probs(tiled, labels)
    assert got_log_probs.shape == labels.shape
    torch.testing.assert_close(got_log_probs, expected_log_probs, rtol=1e-5, atol=1e-6)
    assert (got_log_probs[labels == IGNORE_INDEX] == 0).all() and (got_log_probs[labels != IGNORE_INDEX] < 0).all()
    reference = torch.log_softmax(whole, -1).gather(-1, labels.clamp(min=0)[..., None])[..., 0]
    torch.testing.assert_close(
        got_log_probs[labels != IGNORE_INDEX], reference[labels != IGNORE_INDEX], rtol=1e-5, atol=1e-6
    )


@pytest.mark.parametrize("grad", [False, True], ids=["evaluation", "training"])
def test_tiled_logits_never_build_the_tokens_by_vocab_logits(grad: bool) -> None:
    tokens, vocab, num_tiles = 512, 2048, 8
    hidden_states, lm_head, labels = _inputs(tokens=tokens, hidden=32, vocab=vocab)
    hidden_states.requires_grad_(grad)
    tile_logits = math.ceil(tokens / num_tiles) * vocab

    def largest(logits_of: Callable[[], Logits]) -> int:
        with torch.set_grad_enabled(grad), LargestTensor() as mode:
            logits = logits_of()
            values = [token_cross_entropy(logits, labels)[0], token_log_probs(logits, labels)]
            if grad:
                sum(value.sum() for value in values).backward()
            else:
                TokenAccuracy().update(logits, labels)
        return mode.numel

    assert largest(lambda: lm_head(hidden_states)) >= tokens * vocab  # the detector sees the whole logits
    assert largest(lambda: TiledLogits(hidden_states, lm_head, num_tiles)) <= tile_logits


class WholeSized(TorchDispatchMode):
    """Counts the new tensors of ``numel`` elements (not views of an operation's inputs) that operations make while
    active."""

    def __init__(self, numel: int) -> None:
        super().__init__()
        self.numel, self.count = numel, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {t.untyped_storage().data_ptr() for t in tree_leaves((args, kwargs)) if isinstance(t, Tensor)}
        self.count += sum(
            isinstance(t, Tensor) and t.numel() == self.numel and t.untyped_storage().data_ptr() not in inputs
            for t in tree_leaves(out)
        )
        return out


@pytest.mark.parametrize("num_tiles", [7, 60])  # 50 tokens: 7 tiles do not divide them, 60 leave 10 empty
def test_tiles_gradients_are_joined_once(num_tiles: int) -> None:
    x = torch.randn(2, 50, 8, requires_grad=True)
    expected = [t.shape for t in x.tensor_split(num_tiles, dim=-2)]
    assert [t.shape for t in split_tiles(x, num_tiles, dim=-2)] == expected
    hidden_states, lm_head, labels = _inputs(tokens=50, hidden=8, vocab=32)
    hidden_states.requires_grad_(True)
    for inputs, make_loss in [
        (x, lambda: tiled_map(torch.tanh, x, num_tiles).sum()),
        (hidden_states, lambda: token_cross_entropy(TiledLogits(hidden_states, lm_head, num_tiles), labels)[0]),
    ]:
        loss = make_loss()
        # the backward makes the inputs' gradient once (one cat of the tiles' gradients), not one whole-shaped
        # buffer per tile (tensor_split's slice nodes, run after every tile's backward, quadratic in the length)
        with WholeSized(inputs.numel()) as mode:
            loss.backward()
        assert mode.count == 1


# ----------------------------------------------------------------------------------------------
# tiled_loss=True: tiles sized by bytes
# ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("tokens", "hidden", "vocab", "dtype"),
    [
        (37, 16, 101, torch.float32),  # fewer tokens than the vocabulary: lm_head's weight bounds the tile
        (300, 16, 101, torch.float32),  # more: the hidden states do
        (3000, 16, 101, torch.float32),  # far more: the former tile of hidden tokens caps it
        (8192, 128, 16000, torch.float32),  # benchmarks.memory's model at sp=1: 42-token tiles (former: 128)
        (1000, 4096, 128256, torch.bfloat16),  # Llama-3.1-8B's widths: 682-token tiles
        (5, 2, 4096, torch.float32),  # the bound needs less than a token: one-token tiles, the least there is
    ],
)
def test_loss_tiles_hold_the_byte_bound(tokens: int, hidden: int, vocab: int, dtype: torch.dtype) -> None:
    """A tile's cross-entropy transients fit in lm_head's weight or the rank's hidden states, whichever is larger,
    the tile is never above the former hidden-token tile, and the count is the fewest that does both."""
    hidden_states = torch.zeros(1, tokens, hidden, dtype=dtype)
    num_tiles = resolve_loss_tiles(True, hidden_states, vocab_size=vocab)
    budget = max(tokens, vocab) * hidden * hidden_states.element_size()

    def holds(tile: int) -> bool:
        return tile <= hidden and (tile * vocab * CROSS_ENTROPY_BYTES_PER_LOGIT <= budget or tile == 1)

    assert holds(math.ceil(tokens / num_tiles))
    if num_tiles > 1:  # the fewest tiles that hold it: one fewer would not
        assert not holds(math.ceil(tokens / (num_tiles - 1)))
    assert resolve_loss_tiles(7, hidden_states) == 7 and resolve_loss_tiles(False, hidden_states) == 1


def test_auto_loss_tiles_need_the_vocabulary() -> None:
    hidden_states, lm_head, labels = _inputs()
    loss = UlyssesLossMixin()
    with pytest.raises(ValueError, match="pass vocab_size="):
        loss.tiled_causal_lm_loss(hidden_states, lambda h: lm_head(h), labels, num_tiles=True)
    given = loss.tiled_causal_lm_loss(hidden_states, lambda h: lm_head(h), labels, num_tiles=True, vocab_size=101)
    torch.testing.assert_close(given, loss.tiled_causal_lm_loss(hidden_states, lm_head, labels, num_tiles=True))
    loss.tiled_causal_lm_loss(hidden_states, lambda h: lm_head(h), labels, num_tiles=3)  # an int needs none


class LargestLogits(TorchDispatchMode):
    """Records the element count of the largest ``[rows, vocab]`` tensor that any operation returns while active,
    but for ``[hidden, vocab]``: the weight's gradient, which ``mm``'s backward makes transposed."""

    def __init__(self, vocab: int, hidden: int) -> None:
        super().__init__()
        self.vocab, self.hidden, self.numel = vocab, hidden, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        tensors = [t for t in tree_leaves(out) if isinstance(t, Tensor) and t.dim() == 2]
        shaped = [t.numel() for t in tensors if t.shape[1] == self.vocab and t.shape[0] != self.hidden]
        self.numel = max([self.numel, *shaped])
        return out


@pytest.mark.parametrize(("head_is_module", "runs_per_tile"), [(True, 1), (False, 2)], ids=["fused", "checkpointed"])
def test_auto_loss_tiles_bound_the_logit_tiles_of_a_training_step(head_is_module: bool, runs_per_tile: int) -> None:
    """Each tile's logits are made once per step where the loss is fused (lm_head a module with whole parameters:
    its backward runs in the forward), twice where the tiles are checkpointed (a plain function: the forward and
    the recomputation); never more than one tile's logits at a time."""
    tokens, hidden, vocab = 300, 9, 512  # a tile of 9 * 4 // 12 = 3 tokens: 100 tiles
    hidden_states, lm_head, labels = _inputs(tokens=tokens, hidden=hidden, vocab=vocab)
    hidden_states.requires_grad_(True)
    calls = []
    lm_head.register_forward_hook(lambda module, args, out: calls.append(args[0].shape[0]))
    head = lm_head if head_is_module else lambda h: lm_head(h)
    with LargestLogits(vocab, hidden) as mode:
        loss = UlyssesLossMixin().tiled_causal_lm_loss(hidden_states, head, labels, num_tiles=True, vocab_size=vocab)
        loss.backward()
    tile_tokens = loss_tile_tokens(tokens, hidden, vocab, 4)
    assert tile_tokens == 3 and calls == [tile_tokens] * (runs_per_tile * tokens // tile_tokens)
    assert mode.numel == tile_tokens * vocab  # the largest logits-shaped tensor: one tile's
    whole = token_cross_entropy(lm_head(hidden_states.detach()), labels)
    torch.testing.assert_close(loss, whole[0] / whole[1], rtol=1e-5, atol=0)
