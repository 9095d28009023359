"""The fused tiled loss equals the plain cross entropy in value and every gradient, and runs ``lm_head`` once a tile.

:func:`~lightning_ulysses.logits.fused_loss_sum` (each tile's backward inside the forward, the gradients scaled by the
incoming one in the backward) must give ``F.cross_entropy(head(h).float(), y, reduction="sum")`` and its gradients
for the hidden states, ``lm_head``'s weight and bias: through a :class:`~lightning_ulysses.logits.LogitMap` (scale,
input scale, soft-cap), with tied embeddings (the two gradients add up), ignored labels, empty tiles, a loss multiplied
by a tensor (the gradients scaled by exactly that factor) and gradients accumulated over calls. The effects: each tile's
backward runs inside the forward and ``lm_head`` runs once per tile and step; no host sync in the forward or the
backward; where an engine shards ``lm_head``'s parameters (FSDP2, ZeRO-3) and where no gradient is needed, the
checkpointed tiles run as before. One process each.

A head whose forward reads a tensor needing a gradient besides its own parameters (the fused backward would leave that
gradient out) is refused: handed to the loss directly, at its first tile; inside a transformers model, at set-up by
``check_tiled_logits`` (another module's weight, a tensor outside the model, with and without a logit map, a head
without a weight of its own; accepted where the loss is not fused, ZeRO-3 or evaluation, and for plain, tied and
wrapped heads; no gradient made). One process fits tiny Llamas written by ``save_pretrained`` and loaded by
``from_pretrained`` with ``tiled_loss=True``: with such a head it is refused at set-up under ZeRO-2 (no training step,
weights unchanged, the tensor named) and trains under FSDP2; with tied embeddings it trains.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.distributed.tensor import DTensor
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves
from torch.utils.data import DataLoader
from transformers import PreTrainedModel

from lightning_ulysses import UlyssesLossMixin, UlyssesStrategy
from lightning_ulysses.hf import UnsupportedModelError, apply_ulysses_attention, remove_ulysses_attention
from lightning_ulysses.hf.check.logits import check_tiled_logits
from lightning_ulysses.logits import LogitMap, TiledLogits, cross_entropy_sum, fused_loss_sum
from lightning_ulysses.sharding import IGNORE_INDEX
from tests.launch import launch
from tests.test_host_syncs import HostSyncs
from tests.tiny import collate, cpu_trainer, make_samples, tiny_llama

HIDDEN, VOCAB = 16, 50
MAPS = {
    "identity": LogitMap(),
    "scaled": LogitMap(input_scale=0.5, scale=0.25),
    "soft_capped": LogitMap(input_scale=2.0, scale=0.3, cap=0.7),
}


def _inputs(tokens: int = 23, bias: bool = True) -> tuple[nn.Linear, Tensor, Tensor]:
    torch.manual_seed(0)
    lm_head = nn.Linear(HIDDEN, VOCAB, bias=bias)
    hidden_states = torch.randn(tokens, HIDDEN, requires_grad=True)
    labels = torch.randint(0, VOCAB, (tokens,))
    labels[3:8] = IGNORE_INDEX
    return lm_head, hidden_states, labels


def _grads(loss: Tensor, tensors: list[Tensor]) -> list[Tensor]:
    return list(torch.autograd.grad(loss, tensors))


@pytest.mark.parametrize("logit_map", MAPS.values(), ids=MAPS.keys())
@pytest.mark.parametrize("num_tiles", [1, 4, 30])  # 23 tokens: 4 tiles do not divide them, 30 leave 7 empty
def test_fused_sum_equals_plain_cross_entropy(logit_map: LogitMap, num_tiles: int) -> None:
    lm_head, hidden_states, labels = _inputs()
    head = logit_map.head(lm_head)
    tensors = [hidden_states, lm_head.weight, lm_head.bias]
    factor = torch.tensor(0.37)  # a loss scale, 1/k of accumulation, the SP gradient scale: any tensor
    expected = F.cross_entropy(head(hidden_states).float(), labels, reduction="sum")
    expected_grads = _grads(expected * factor, tensors)

    loss_sum = fused_loss_sum(head, num_tiles)
    assert loss_sum is not None
    got = loss_sum(hidden_states, labels, IGNORE_INDEX)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, expected, rtol=1e-6, atol=0)
    for g, e in zip(_grads(got * factor, tensors), expected_grads, strict=True):
        torch.testing.assert_close(g, e, rtol=1e-5, atol=1e-7)


def test_the_incoming_gradient_scales_every_gradient_exactly() -> None:
    """The backward multiplies the saved gradients by the loss's gradient: never taken as 1 (ALST's weight gradient),
    so a factor of 0.37 or of 1000 gives exactly that multiple of the gradients at factor 1."""
    lm_head, hidden_states, labels = _inputs()
    tensors = [hidden_states, lm_head.weight, lm_head.bias]
    loss_sum = fused_loss_sum(lm_head, 3)
    assert loss_sum is not None
    at_one = _grads(loss_sum(hidden_states, labels, IGNORE_INDEX), tensors)
    for factor in (torch.tensor(0.37), torch.tensor(1000.0)):
        scaled = _grads(loss_sum(hidden_states, labels, IGNORE_INDEX) * factor, tensors)
        for g, one in zip(scaled, at_one, strict=True):
            assert torch.equal(g, one * factor)


def test_tied_embeddings_add_both_gradients() -> None:
    """lm_head's weight is the input embedding's: the fused gradient and the embedding's add up, as without fusion."""
    torch.manual_seed(0)
    embedding = nn.Embedding(VOCAB, HIDDEN)
    lm_head = nn.Linear(HIDDEN, VOCAB, bias=False)
    lm_head.weight = embedding.weight
    ids = torch.randint(0, VOCAB, (19,))
    labels = torch.roll(ids, -1)
    mix = nn.Linear(HIDDEN, HIDDEN)  # a "decoder" between the two uses of the weight

    def loss(fused: bool) -> Tensor:
        hidden_states = torch.tanh(mix(embedding(ids)))
        if not fused:
            return F.cross_entropy(lm_head(hidden_states), labels, reduction="sum") / 19
        loss_sum = fused_loss_sum(lm_head, 4)
        assert loss_sum is not None
        return loss_sum(hidden_states, labels, IGNORE_INDEX) / 19

    tensors = [embedding.weight, mix.weight, mix.bias]
    expected, got = _grads(loss(False), tensors), _grads(loss(True), tensors)
    for g, e in zip(got, expected, strict=True):
        torch.testing.assert_close(g, e, rtol=1e-5, atol=1e-7)


def test_accumulated_gradients_equal_the_plain_ones() -> None:
    """Two micro-batches, each loss divided by 2 (Lightning's accumulation), backward into ``.grad``."""
    lm_head, hidden_states, labels = _inputs()
    parts = [(hidden_states[:11], labels[:11]), (hidden_states[11:], labels[11:])]
    for h, y in parts:
        (F.cross_entropy(lm_head(h), y, reduction="sum") / 2).backward()
    expected = [hidden_states.grad.clone(), lm_head.weight.grad.clone(), lm_head.bias.grad.clone()]
    hidden_states.grad = lm_head.weight.grad = lm_head.bias.grad = None
    loss_sum = fused_loss_sum(lm_head, 3)
    assert loss_sum is not None
    for h, y in parts:
        (loss_sum(h, y, IGNORE_INDEX) / 2).backward()
    for g, e in zip([hidden_states.grad, lm_head.weight.grad, lm_head.bias.grad], expected, strict=True):
        torch.testing.assert_close(g, e, rtol=1e-5, atol=1e-7)


def test_without_valid_labels_the_sum_and_gradients_are_zero() -> None:
    lm_head, hidden_states, _ = _inputs(tokens=5)
    loss_sum = fused_loss_sum(lm_head, 2)
    assert loss_sum is not None
    loss = loss_sum(hidden_states, torch.full((5,), IGNORE_INDEX), IGNORE_INDEX)
    loss.backward()
    assert loss.item() == 0.0
    assert not hidden_states.grad.any() and not lm_head.weight.grad.any() and not lm_head.bias.grad.any()


def test_frozen_hidden_states_or_lm_head_get_no_gradient() -> None:
    """Only what needs a gradient gets one: a frozen decoder's output, or a frozen lm_head (no gradient buffer)."""
    lm_head, hidden_states, labels = _inputs()
    loss_sum = fused_loss_sum(lm_head, 3)
    assert loss_sum is not None
    frozen_input = hidden_states.detach()
    loss_sum(frozen_input, labels, IGNORE_INDEX).backward()
    assert frozen_input.grad is None and lm_head.weight.grad is not None
    expected = _grads(F.cross_entropy(lm_head(frozen_input), labels, reduction="sum"), [lm_head.weight])
    torch.testing.assert_close(lm_head.weight.grad, expected[0], rtol=1e-5, atol=1e-7)
    lm_head.requires_grad_(False)
    lm_head.weight.grad = None
    loss_sum(hidden_states, labels, IGNORE_INDEX).backward()
    assert lm_head.weight.grad is None and hidden_states.grad is not None


def test_fp16_gradients_are_summed_in_fp32() -> None:
    """A tile's gradient is taken at an incoming gradient of 1: summed over 2000 tokens of one label, the weight's
    is about -2e5, past fp16's largest value (65504), while the loss's own gradient (1 / tokens) brings it back to
    about -100. Summed in fp16 it would be infinite."""
    torch.manual_seed(0)
    tokens = 2000
    lm_head = nn.Linear(HIDDEN, VOCAB, bias=False).half()
    hidden_states = torch.full((tokens, HIDDEN), 100.0, dtype=torch.float16, requires_grad=True)
    labels = torch.zeros(tokens, dtype=torch.long)
    loss_sum = fused_loss_sum(lm_head, 20)
    assert loss_sum is not None
    (loss_sum(hidden_states, labels, IGNORE_INDEX) / tokens).backward()
    reference = nn.Linear(HIDDEN, VOCAB, bias=False)
    reference.weight.data = lm_head.weight.detach().float()
    (F.cross_entropy(reference(hidden_states.detach().float()), labels, reduction="sum") / tokens).backward()
    assert lm_head.weight.grad.dtype == torch.float16 and lm_head.weight.grad.isfinite().all()
    assert reference.weight.grad.abs().max() > 65504 / tokens * 2  # the unscaled sum passes fp16's range
    torch.testing.assert_close(lm_head.weight.grad.float(), reference.weight.grad, rtol=1e-2, atol=1e-2)


# ----------------------------------------------------------------------------------------------
# effects: where the backward runs, how often lm_head runs, host syncs
# ----------------------------------------------------------------------------------------------
class Runs:
    """Counts ``lm_head``'s forward calls and backward runs, and the backward runs seen before ``loss.backward()``."""

    def __init__(self, module: nn.Module) -> None:
        self.forward = self.backward = 0
        module.register_forward_hook(lambda *_: self._add("forward"))
        module.register_full_backward_hook(lambda *_: self._add("backward"))

    def _add(self, what: str) -> None:
        setattr(self, what, getattr(self, what) + 1)


@pytest.mark.parametrize("num_tiles", [1, 5])
def test_each_tile_runs_lm_head_once_and_its_backward_in_the_forward(num_tiles: int) -> None:
    lm_head, hidden_states, labels = _inputs()
    runs = Runs(lm_head)
    tiled = TiledLogits(hidden_states, lm_head, num_tiles, fused_loss_sum(lm_head, num_tiles))
    loss = cross_entropy_sum(tiled, labels)
    assert (runs.forward, runs.backward) == (num_tiles, num_tiles)  # every tile's backward already ran
    loss.backward()
    assert (runs.forward, runs.backward) == (num_tiles, num_tiles)  # and lm_head runs in no recomputation


def test_without_a_gradient_the_tiles_run_forward_only() -> None:
    """Evaluation (no grad mode) takes the tiles' values, with no gradient made."""
    lm_head, hidden_states, labels = _inputs()
    runs = Runs(lm_head)
    expected = F.cross_entropy(lm_head(hidden_states), labels, reduction="sum")
    runs.forward = 0
    with torch.no_grad():
        got = cross_entropy_sum(TiledLogits(hidden_states, lm_head, 4, fused_loss_sum(lm_head, 4)), labels)
    assert (runs.forward, runs.backward) == (4, 0) and got.grad_fn is None
    torch.testing.assert_close(got, expected.detach(), rtol=1e-6, atol=0)


def test_no_host_sync_in_the_fused_forward_or_backward() -> None:
    lm_head, hidden_states, labels = _inputs()
    loss_sum = fused_loss_sum(MAPS["soft_capped"].head(lm_head), 5)
    assert loss_sum is not None
    counter = HostSyncs()
    with counter.methods_counted():
        counter.where = "forward"
        loss = loss_sum(hidden_states, labels, IGNORE_INDEX) * torch.tensor(0.5)
        counter.where = "backward"
        loss.backward()
        counter.where = "outside"
        bool(loss != 1.0)  # ALST's check of the incoming gradient, which the counter sees
    inside = {key: n for key, n in counter.counts.items() if key[0] != "outside"}
    assert not inside, f"host syncs in the fused loss: {inside}"
    assert counter.counts, "the counter missed a host sync"


class LiveWeightSized(TorchDispatchMode):
    """The most storages of ``nbytes`` bytes made while active (``lm_head``'s weight gradients) alive at once; views
    and in-place results (an output sharing an input's storage) are not made."""

    def __init__(self, nbytes: int) -> None:
        super().__init__()
        self.nbytes, self.most = nbytes, 0
        self.live: dict[int, StorageWeakRef] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.live = {key: ref for key, ref in self.live.items() if not ref.expired()}
        inputs = {t.untyped_storage().data_ptr() for t in tree_leaves((args, kwargs)) if isinstance(t, Tensor)}
        for tensor in tree_leaves(out):
            storage = tensor.untyped_storage() if isinstance(tensor, Tensor) else None
            if storage is not None and storage.nbytes() == self.nbytes and storage.data_ptr() not in inputs:
                self.live.setdefault(storage.data_ptr(), StorageWeakRef(storage))
        self.most = max(self.most, len(self.live))
        return out


def test_one_tile_weight_gradient_alive_beside_their_sum() -> None:
    """While the forward makes the tiles' gradients, at most the sum and one tile's ``[V, hidden]`` weight gradient
    exist: each tile's is freed (added) before the next tile's backward makes its own."""
    lm_head, hidden_states, labels = _inputs(bias=False)
    loss_sum = fused_loss_sum(lm_head, 5)
    assert loss_sum is not None
    with LiveWeightSized(lm_head.weight.numel() * 4) as mode:
        loss_sum(hidden_states, labels, IGNORE_INDEX)
    assert mode.most == 2


def test_the_hidden_states_are_not_kept_for_the_backward() -> None:
    """The backward needs only the gradients the forward made: hidden states the caller drops (a training_step returns
    its loss) are freed before the backward, not held through the decoder's backward (one ``[B, N/sp, hidden]``)."""
    lm_head, leaf, labels = _inputs()
    hidden_states = (leaf * 2).unsqueeze(0)  # made by the graph, as a decoder's output (a leaf is held by its node)
    kept = StorageWeakRef(hidden_states.untyped_storage())
    loss = UlyssesLossMixin().tiled_causal_lm_loss(hidden_states, lm_head, labels.unsqueeze(0), 4)
    del hidden_states
    assert kept.expired()
    loss.backward()
    assert leaf.grad is not None


def test_a_second_backward_is_refused() -> None:
    lm_head, hidden_states, labels = _inputs()
    loss_sum = fused_loss_sum(lm_head, 2)
    assert loss_sum is not None
    loss = loss_sum(hidden_states, labels, IGNORE_INDEX)
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="its backward runs once"):
        loss.backward()


def test_a_head_reading_a_tensor_outside_its_parameters_is_refused() -> None:
    """A head module whose forward reads another module's weight: the fused backward would drop that gradient."""
    lm_head, hidden_states, labels = _inputs()

    class Borrowing(nn.Module):
        def forward(self, x: Tensor) -> Tensor:
            return lm_head(x)

    loss_sum = fused_loss_sum(Borrowing(), 2)
    assert loss_sum is not None
    with pytest.raises(RuntimeError, match="none of its parameters"):
        loss_sum(hidden_states, labels, IGNORE_INDEX)
    assert fused_loss_sum(lambda x: lm_head(x), 2) is None  # a function: its tensors cannot be listed


def read_in_lm_head(model: PreTrainedModel, tensor: Tensor) -> None:
    """Make ``model``'s ``lm_head`` read ``tensor`` in its forward, as a head that is not only its own parameters
    would: ``lm_head(h * tensor)`` (``tensor`` of ones leaves the logits as they were)."""
    lm_head = model.get_output_embeddings()
    forward = lm_head.forward
    lm_head.forward = lambda hidden: forward(hidden * tensor)


class WrappedHead(nn.Module):
    """An output embedding with no weight of its own, holding the linear layer (the set-up check then takes its probe's
    hidden size from the config)."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.linear = linear

    def forward(self, hidden_states: Tensor) -> Tensor:
        return self.linear(hidden_states)


def head_model(head: str, **overrides: Any) -> PreTrainedModel:
    """A tiny Llama (Granite with ``logits_scaling=4``: ``lm_head(h) / 4``) whose ``lm_head`` is a linear layer or,
    ``"wrapped"``, a :class:`WrappedHead`."""
    if head == "granite_scaled":
        overrides = dict(overrides, model_type="granite", logits_scaling=4.0)
    model = tiny_llama(**overrides)
    if head == "wrapped":
        model.lm_head = WrappedHead(model.lm_head)
    return model


@pytest.mark.parametrize("head", ["linear", "granite_scaled", "wrapped"])
@pytest.mark.parametrize("foreign", ["norm_weight", "outside_the_model"])
def test_the_set_up_check_refuses_a_head_reading_a_trainable_tensor_not_its_own(foreign: str, head: str) -> None:
    """With the training loss fused, a head reading another module's weight (not tied as the same Parameter) or a
    trainable tensor outside the model is refused at set-up, naming it; where the loss is not fused (evaluation, an
    engine that shards lm_head: the checkpointed tiles take every gradient) it is accepted. No gradient is made."""
    model = head_model(head)
    tensor = model.model.norm.weight if foreign == "norm_weight" else torch.ones(32, requires_grad=True)
    read_in_lm_head(model, tensor)
    trained = nn.ModuleDict({"model": model})
    apply_ulysses_attention(model, group=None, attn_implementation="sdpa", tiled_loss=True)
    try:
        name = "model.model.norm.weight" if foreign == "norm_weight" else "one that is no parameter of ModuleDict"
        with pytest.raises(
            UnsupportedModelError, match=rf"lm_head \(lm_head\) reads .*: {name} \(32,\)\..*tiled_loss=False"
        ):
            check_tiled_logits(trained, fused_training=True)
        assert all(p.grad is None for p in model.parameters()) and tensor.grad is None
        found = check_tiled_logits(trained)  # not fused: evaluation, ZeRO-3, FSDP2 (whose check runs before sharding)
        assert found == ("GraniteForCausalLM: 0.25 * lm_head(h)" if head == "granite_scaled" else None)
        for parameter in model.lm_head.parameters():
            parameter.ds_id = 0  # type: ignore[attr-defined]  # ZeRO-3's partitioned parameters: checkpointed tiles
        assert check_tiled_logits(trained, fused_training=True) == found
    finally:
        remove_ulysses_attention(model)


@pytest.mark.parametrize("head", ["linear", "tied_embeddings", "wrapped"])
def test_the_set_up_check_accepts_a_head_of_its_own_parameters(head: str) -> None:
    """lm_head's own weight, the input embedding's as the same Parameter (tied), or a submodule's, is accepted with
    the loss fused."""
    model = head_model(head, tie_word_embeddings=head == "tied_embeddings")
    tied = getattr(model.get_output_embeddings(), "weight", None) is model.model.embed_tokens.weight
    assert tied == (head == "tied_embeddings")
    apply_ulysses_attention(model, group=None, attn_implementation="sdpa", tiled_loss=True)
    try:
        assert check_tiled_logits(nn.ModuleDict({"model": model}), fused_training=True) is None
    finally:
        remove_ulysses_attention(model)


class HeadTraining(UlyssesLossMixin, L.LightningModule):
    """Trains a transformers causal LM with :meth:`forward_causal_lm_loss` (tiled under the strategy's
    ``tiled_loss``), counting its training steps."""

    def __init__(self, model: PreTrainedModel) -> None:
        super().__init__()
        self.model = model
        self.steps = 0

    def training_step(self, batch: dict[str, Tensor], batch_idx: int) -> Tensor:
        self.steps += 1
        return self.forward_causal_lm_loss(self.model, batch)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def head_fits(args: dict[str, Any]) -> dict[str, Any]:
    """One rank, one step each, ``tiled_loss=True``, on the saved tiny Llamas loaded with ``from_pretrained``: its
    lm_head reading the final norm's weight under ZeRO-2 and under FSDP2; with tied embeddings under ZeRO-2."""
    from transformers import AutoModelForCausalLM

    from lightning_ulysses import UlyssesFSDPStrategy

    results = {}
    for name in ("foreign", "foreign_fsdp2", "tied"):
        model = AutoModelForCausalLM.from_pretrained(args[name.split("_")[0]], attn_implementation="sdpa")
        if name.startswith("foreign"):
            read_in_lm_head(model, model.model.norm.weight)
        module = HeadTraining(model)
        initial = {n: p.detach().clone() for n, p in model.named_parameters()}
        strategy = (
            UlyssesFSDPStrategy(sp_size=1, attn_implementation="sdpa", tiled_loss=True)
            if name == "foreign_fsdp2"
            else UlyssesStrategy(sp_size=1, stage=2, attn_implementation="sdpa", tiled_loss=True)
        )
        loader = DataLoader(make_samples(num=2, seq_len=16), batch_size=2, collate_fn=collate)
        error = None
        try:
            cpu_trainer(1, strategy, max_steps=1).fit(module, loader)
        except Exception as raised:  # noqa: BLE001 - the test reads which error, and when
            error = f"{type(raised).__name__}: {raised}"
        changed = [n for n, p in model.named_parameters() if not torch.equal(full(p.detach()), initial[n])]
        results[name] = {"error": error, "steps": module.steps, "changed": changed}
    return results


def full(tensor: Tensor) -> Tensor:
    """The whole tensor of an FSDP2-sharded parameter (a ``DTensor``), else ``tensor``."""
    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


@pytest.mark.distributed
def test_a_loaded_model_whose_head_reads_another_weight_is_refused_at_set_up(tmp_path: Path) -> None:
    """The user's path: a model from ``from_pretrained`` whose lm_head reads the final norm's weight is refused by
    ``UlyssesStrategy(tiled_loss=True)`` at set-up, before any training step, its weights unchanged, the message naming
    the tensor; under FSDP2 (the checkpointed tiles, which take every gradient, though its check runs before the
    sharding) it trains, and so does a model with tied embeddings (lm_head's weight the embedding's Parameter)."""
    for name, tied in (("foreign", False), ("tied", True)):
        tiny_llama(tie_word_embeddings=tied).save_pretrained(tmp_path / name)
    (results,) = launch("tests.test_fused_loss:head_fits", 1, {n: str(tmp_path / n) for n in ("foreign", "tied")})
    refused = results["foreign"]
    assert refused["error"] is not None and refused["error"].startswith("UnsupportedModelError"), refused
    assert "model.model.norm.weight (32,)" in refused["error"] and "tiled_loss=False" in refused["error"], refused
    assert refused["steps"] == 0 and refused["changed"] == [], refused
    for name, moved in (("foreign_fsdp2", "model.norm.weight"), ("tied", "model.embed_tokens.weight")):
        trained = results[name]
        assert trained["error"] is None and trained["steps"] == 1 and moved in trained["changed"], (name, trained)


# ----------------------------------------------------------------------------------------------
# engines that shard lm_head's parameters keep the checkpointed tiles
# ----------------------------------------------------------------------------------------------
def test_fsdp2_sharded_lm_head_keeps_the_checkpointed_tiles(one_rank: None) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    lm_head, hidden_states, labels = _inputs()
    expected = _grads(F.cross_entropy(lm_head(hidden_states), labels, reduction="sum"), [hidden_states])
    fully_shard(lm_head, mesh=init_device_mesh("cpu", (1,)))
    assert fused_loss_sum(lm_head, 3) is None
    runs = Runs(lm_head)
    loss = cross_entropy_sum(TiledLogits(hidden_states, lm_head, 3, fused_loss_sum(lm_head, 3)), labels)
    loss.backward()
    assert runs.forward == 2 * 3  # the forward and the recomputation in the backward
    torch.testing.assert_close(hidden_states.grad, expected[0], rtol=1e-5, atol=1e-7)


def test_zero3_partitioned_lm_head_keeps_the_checkpointed_tiles() -> None:
    """ZeRO-3 marks its partitioned parameters with ``ds_id`` (gathered or not)."""
    lm_head, _, _ = _inputs()
    assert fused_loss_sum(LogitMap(scale=2.0).head(lm_head), 3) is not None
    lm_head.weight.ds_id = 0
    assert fused_loss_sum(LogitMap(scale=2.0).head(lm_head), 3) is None
    assert fused_loss_sum(lm_head, 3) is None
