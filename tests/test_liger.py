"""Liger kernels (``liger_kernels``): what is replaced, found by behaviour, refused where it cannot run, and exact.

On CPU (no Triton) the wiring runs against ``liger_kernel.transformers.functional`` stood in by PyTorch functions
with Liger's semantics: the RMSNorms and SwiGLU feed-forwards found are replaced and undone, the model's outputs and
gradients stay the plain model's, and the fused loss folds the model's logit scale and soft-cap as the tiled loss
applies them. On a GPU the real kernels run in bf16 against the float64 model.
"""

from __future__ import annotations

import importlib.util
import sys
import types

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.nn.utils import parametrize

from lightning_ulysses import UlyssesStrategy
from lightning_ulysses.liger import (
    apply_liger_kernels,
    check_liger_kernels,
    liger_loss_sum,
    refuse_liger_setup,
    remove_liger_kernels,
    swiglu_projections,
)
from lightning_ulysses.logits import LogitMap, TiledLogits, tiled_cross_entropy_sum
from lightning_ulysses.loss import token_cross_entropy
from tests.tiny import tiny_llama


def _rms_norm(
    x: Tensor, w: Tensor, eps: float, offset: float = 0.0, casting_mode: str = "llama", **_: object
) -> Tensor:
    """Liger's RMSNorm: ``"llama"`` casts the normalised input back before the weight, ``"gemma"`` after."""
    u = x.float()
    xhat = u * torch.rsqrt(u.pow(2).mean(-1, keepdim=True) + eps)
    if casting_mode == "llama":
        return (offset + w) * xhat.to(x.dtype)
    return (xhat * (offset + w.float())).to(x.dtype)


def _fused_linear_cross_entropy(
    x: Tensor, w: Tensor, y: Tensor, b: Tensor | None, ignore_index: int, reduction: str, softcap: float | None
) -> Tensor:
    logits = F.linear(x, w, b).float()
    if softcap is not None:
        logits = softcap * torch.tanh(logits / softcap)
    return F.cross_entropy(logits, y, ignore_index=ignore_index, reduction=reduction)


@pytest.fixture
def stand_in_liger(monkeypatch: pytest.MonkeyPatch) -> dict[str, int]:
    """``liger_kernel.transformers.functional`` as PyTorch functions; returns the calls of each."""
    calls = {"rms_norm": 0, "swiglu": 0, "cross_entropy": 0}

    def counted(name: str, fn: object) -> object:
        def call(*args: object, **kwargs: object) -> object:
            calls[name] += 1
            return fn(*args, **kwargs)  # type: ignore[operator]

        return call

    functional = types.ModuleType("liger_kernel.transformers.functional")
    functional.liger_rms_norm = counted("rms_norm", _rms_norm)  # type: ignore[attr-defined]
    functional.liger_swiglu = counted("swiglu", lambda a, b: F.silu(a) * b)  # type: ignore[attr-defined]
    functional.liger_fused_linear_cross_entropy = counted(  # type: ignore[attr-defined]
        "cross_entropy", _fused_linear_cross_entropy
    )
    for name in ("liger_kernel", "liger_kernel.transformers"):
        monkeypatch.setitem(sys.modules, name, types.ModuleType(name))
    monkeypatch.setitem(sys.modules, "liger_kernel.transformers.functional", functional)
    return calls


def _logits_and_grads(model: nn.Module, ids: Tensor) -> list[Tensor]:
    logits = model(input_ids=ids).logits
    return [logits, *torch.autograd.grad(logits.logsumexp(-1).mean(), list(model.parameters()))]


@pytest.mark.parametrize("model_type", ["llama", "gemma"])
def test_norms_and_feed_forwards_found_are_replaced_exactly_and_undone(
    stand_in_liger: dict[str, int], model_type: str
) -> None:
    """Llama's norms (cast before the weight) and Gemma's (``1 + weight``, in float), and Llama's SwiGLU; Gemma's
    feed-forward (a tanh-GELU gate) is no SwiGLU and is refused when asked alone."""
    model = tiny_llama(model_type=model_type, head_dim=8, hidden_act="silu", hidden_activation="silu").train()
    ids = torch.randint(1, 60, (2, 12), generator=torch.Generator().manual_seed(0))
    expected = _logits_and_grads(model, ids)
    norm, mlp = type(model.model.norm).__name__, type(model.model.layers[0].mlp).__name__
    rows = apply_liger_kernels(model, ("rms_norm", "swiglu"))
    assert [row.applies for row in rows] == [
        f"model.layers.*.input_layernorm ({norm}) x2, model.layers.*.post_attention_layernorm ({norm}) x2, "
        f"model.norm ({norm}): Liger's Triton kernel",
        f"model.layers.*.mlp ({mlp}) x2: Liger's Triton kernel",
    ]
    got = _logits_and_grads(model, ids)
    assert stand_in_liger["rms_norm"] == 5 and stand_in_liger["swiglu"] == 2
    for g, e in zip(got, expected, strict=True):
        torch.testing.assert_close(g, e, rtol=1e-5, atol=1e-6)
    remove_liger_kernels(model)
    _logits_and_grads(model, ids)
    assert stand_in_liger["rms_norm"] == 5 and stand_in_liger["swiglu"] == 2
    if model_type == "gemma":
        with pytest.raises(ValueError, match="liger_kernels 'swiglu' found no SwiGLU feed-forward"):
            apply_liger_kernels(tiny_llama(model_type="gemma", head_dim=8), ("swiglu",))


def test_swiglu_is_found_by_what_the_module_computes() -> None:
    llama_mlp = tiny_llama().model.layers[0].mlp
    assert swiglu_projections(llama_mlp) == ("gate_proj", "up_proj", "down_proj")
    gelu_mlp = tiny_llama(hidden_act="gelu").model.layers[0].mlp  # the same three projections around another gate
    assert swiglu_projections(gelu_mlp) is None
    assert swiglu_projections(nn.Sequential(nn.Linear(4, 8, bias=False), nn.SiLU(), nn.Linear(8, 4))) is None


@pytest.mark.parametrize(
    "logit_map", [LogitMap(), LogitMap(input_scale=0.5, scale=3.0), LogitMap(scale=0.7, cap=2.0)], ids=str
)
@pytest.mark.parametrize("bias", [False, True])
def test_fused_loss_applies_the_logit_map_as_the_tiles_do(
    stand_in_liger: dict[str, int], logit_map: LogitMap, bias: bool
) -> None:
    generator = torch.Generator().manual_seed(0)
    lm_head = nn.Linear(16, 50, bias=bias)
    hidden = torch.randn(2, 9, 16, generator=generator, requires_grad=True)
    labels = torch.randint(0, 50, (2, 9), generator=generator)
    labels[0, :3] = -100
    expected = tiled_cross_entropy_sum(hidden, logit_map.head(lm_head), labels, num_tiles=3)
    fused = TiledLogits(hidden, logit_map.head(lm_head), 3, liger_loss_sum(lm_head, logit_map))
    got, valid = token_cross_entropy(fused, labels)  # the loss's path: the fused sum instead of the tiles
    assert valid == 15
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    params = [hidden, *lm_head.parameters()]
    for g, e in zip(torch.autograd.grad(got, params), torch.autograd.grad(expected, params), strict=True):
        torch.testing.assert_close(g, e, rtol=1e-5, atol=1e-6)
    assert stand_in_liger["cross_entropy"] == 1


def test_refused_where_it_cannot_run(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(ValueError, match="liger_kernels takes True, False or a list of 'cross_entropy', 'rms_norm'"):
        check_liger_kernels(["rope"])
    assert check_liger_kernels(False) == ()
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util,
        "find_spec",
        lambda name, *a: object() if name in ("liger_kernel", "triton") else find_spec(name, *a),
    )
    with pytest.raises(ValueError, match="fused_norms and liger_kernels 'rms_norm' both replace the RMSNorms"):
        UlyssesStrategy(sp_size=2, fused_norms=True, liger_kernels=True)
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None)
    with pytest.raises(
        ValueError, match=r"needs the 'liger_kernel' and 'triton' package\(s\), which are not installed"
    ):
        UlyssesStrategy(sp_size=2, liger_kernels=["swiglu"])
    with pytest.raises(ValueError, match="runs Triton kernels on CUDA GPUs, and this run is on cpu"):
        refuse_liger_setup(("swiglu",), "cpu", False, False)
    with pytest.raises(ValueError, match=r"takes lm_head's weight whole, which ZeRO-3 \(and FSDP2\) partitions"):
        refuse_liger_setup(("cross_entropy",), "cuda", True, True)
    with pytest.raises(ValueError, match="is the fused form of tiled_loss: set tiled_loss=True"):
        refuse_liger_setup(("cross_entropy",), "cuda", False, False)
    with pytest.raises(ValueError, match="computes lm_head as a linear layer"):
        liger_loss_sum(nn.Embedding(4, 4), LogitMap())


class LoRALinear(nn.Linear):
    """loralib's ``Linear``: an ``nn.Linear`` whose own forward adds a trainable low-rank update (``lora_B`` zero at
    first, as LoRA starts, so the loss is the base model's and only the gradients tell)."""

    def __init__(self, base: nn.Linear, rank: int = 2) -> None:
        super().__init__(base.in_features, base.out_features, bias=False)
        self.weight = base.weight
        self.weight.requires_grad_(False)
        self.lora_A = nn.Parameter(torch.randn(rank, base.in_features, generator=torch.Generator().manual_seed(0)))
        self.lora_B = nn.Parameter(torch.zeros(base.out_features, rank))

    def forward(self, x: Tensor) -> Tensor:
        return super().forward(x) + x @ self.lora_A.T @ self.lora_B.T


def test_an_lm_head_that_is_more_than_its_weight_is_refused_before_any_change(stand_in_liger: dict[str, int]) -> None:
    """Liger's loss computes ``F.linear(h, lm_head.weight, lm_head.bias)``: a LoRA adapter inside an ``nn.Linear``
    subclass would lose its gradient (``lora_B``'s is not zero) with the loss unchanged, and a hook would be skipped.
    Both refused at set-up, nothing replaced; a weight computed by a parametrization is what Liger reads, accepted."""
    model = tiny_llama()
    ids = torch.randint(1, 60, (1, 8), generator=torch.Generator().manual_seed(0))
    model.lm_head = LoRALinear(model.lm_head)
    hidden = model.model(input_ids=ids).last_hidden_state.detach()
    plain = F.cross_entropy(model.lm_head(hidden)[0], ids[0], reduction="sum")
    liger = liger_loss_sum(model.lm_head, LogitMap())(hidden[0], ids[0], -100)
    lora_b = model.lm_head.lora_B
    assert torch.autograd.grad(plain, lora_b)[0].norm() > 0  # what Liger's loss would silently leave out
    assert not liger.requires_grad and torch.allclose(liger, plain)
    with pytest.raises(ValueError, match=r"reads tensors that need a gradient besides its weight and bias, shaped"):
        apply_liger_kernels(model, ("rms_norm", "cross_entropy"))
    assert not any("forward" in m.__dict__ for m in model.modules())  # refused before any norm was replaced

    with torch.no_grad():
        lora_b.normal_()  # a trained adapter: the forward differs as well
        model.lm_head.lora_A.requires_grad_(False)
        lora_b.requires_grad_(False)
    with pytest.raises(ValueError, match="computes other than a linear layer of its weight and bias"):
        apply_liger_kernels(model, ("cross_entropy",))
    model.lm_head = nn.Linear(32, model.config.vocab_size, bias=False)
    model.lm_head.register_forward_hook(lambda module, args, out: out * 2)
    with pytest.raises(ValueError, match="computes other than a linear layer of its weight and bias"):
        apply_liger_kernels(model, ("cross_entropy",))

    head = nn.Linear(32, model.config.vocab_size, bias=False)
    model.lm_head = head
    parametrize.register_parametrization(head, "weight", _Doubled())
    assert apply_liger_kernels(model, ("cross_entropy",))[0].option == "liger_kernels 'cross_entropy'"


class _Doubled(nn.Module):
    def forward(self, weight: Tensor) -> Tensor:
        return 2 * weight


@pytest.mark.cuda
def test_liger_kernels_on_cuda_match_the_float64_model_in_bf16_tolerance() -> None:
    """The real kernels in bf16: logits, loss and gradients within the error of the plain bf16 model (each against the
    float64 model), and the fused loss with a scale and a soft-cap against the float64 tiled loss."""
    pytest.importorskip("liger_kernel")
    reference = tiny_llama(hidden_size=256, intermediate_size=512, num_attention_heads=4).cuda().double().train()
    ids = torch.randint(1, 60, (2, 256), generator=torch.Generator().manual_seed(0)).cuda()
    expected = _logits_and_grads(reference, ids)
    plain = tiny_llama(hidden_size=256, intermediate_size=512, num_attention_heads=4).cuda().bfloat16().train()

    def errors(model: nn.Module) -> list[float]:
        got = _logits_and_grads(model, ids)
        return [((g.double() - e).norm() / e.norm()).item() for g, e in zip(got, expected) if e.norm() > 0]

    plain_errors = errors(plain)
    assert apply_liger_kernels(plain, ("rms_norm", "swiglu"))
    for liger, bf16 in zip(errors(plain), plain_errors, strict=True):
        assert liger < max(2 * bf16, 1e-2), (liger, bf16)

    generator = torch.Generator().manual_seed(1)
    lm_head = nn.Linear(256, 1000, bias=False).cuda()
    hidden = torch.randn(512, 256, generator=generator).cuda()
    labels = torch.randint(0, 1000, (512,), generator=generator).cuda()
    logit_map = LogitMap(scale=0.5, cap=30.0)
    expected_sum = tiled_cross_entropy_sum(hidden.double(), logit_map.head(lm_head.double()), labels, 4)
    got_sum = liger_loss_sum(lm_head.bfloat16(), logit_map)(hidden.bfloat16(), labels, -100)
    assert abs(got_sum.item() - expected_sum.item()) / expected_sum.item() < 1e-2
