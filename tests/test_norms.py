"""Fused norms (:mod:`lightning_ulysses.norms`, ``fused_norms``): RMSNorms and LayerNorms found by what they do, bit
for bit the same output, the same gradients, less kept for the backward; gated norms called with a gate run their own
forward; whole-model training under SP is in ``tests/test_memory.py``."""

from __future__ import annotations

import inspect

import pytest
import torch
from torch import Tensor, nn
from transformers.models.cohere.modeling_cohere import CohereLayerNorm
from transformers.models.gemma.modeling_gemma import GemmaRMSNorm
from transformers.models.llama.modeling_llama import LlamaRMSNorm
from transformers.models.mamba2.modeling_mamba2 import MambaRMSNormGated
from transformers.models.olmo2.modeling_olmo2 import Olmo2RMSNorm
from transformers.models.qwen3.modeling_qwen3 import Qwen3RMSNorm

from lightning_ulysses.hf.ledger import Ledger
from lightning_ulysses.memory import MemoryOptions, apply_memory_options, remove_memory_options
from lightning_ulysses.memory.norms import Norm, fuse_norms
from lightning_ulysses.norms import (
    NormForm,
    gated_norm_groups,
    gated_rms_norm,
    layer_norm,
    norm_eps,
    norm_form,
    rms_norm,
)
from tests.tiny import tiny_llama
from tests.zoo_configs import tiny_recipe

HIDDEN = 48


def _norm(name: str, dtype: torch.dtype = torch.float32) -> nn.Module:
    norm = NORMS[name][0](HIDDEN, eps=1e-5)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(HIDDEN) * 0.5 + (name != "gemma"))
        if isinstance(getattr(norm, "bias", None), Tensor):
            norm.bias.copy_(torch.randn(HIDDEN))
    return norm.to(dtype)


def _mamba2_gated_norm(group_size: int, cls: type[MambaRMSNormGated] = MambaRMSNormGated) -> MambaRMSNormGated:
    """Mamba 2's gated RMSNorm over groups of ``group_size``. transformers' class took ``(hidden_size, eps)`` before
    it grew groups (5.17 has no ``group_size``: one group over the whole width); there only one group is asked."""
    if "group_size" in inspect.signature(MambaRMSNormGated.__init__).parameters:
        return cls(HIDDEN, group_size=group_size)
    if group_size != HIDDEN:
        pytest.skip("this transformers' MambaRMSNormGated has no groups (no group_size)")
    return cls(HIDDEN)


def _fused(norm: nn.Module, x: Tensor, form: NormForm) -> Tensor:
    bias = getattr(norm, "bias", None)
    if form in ("layer_norm", "layer_norm_in_float"):
        return layer_norm(x, norm.weight, bias, norm_eps(norm), form)
    return rms_norm(x, norm.weight, norm_eps(norm), form)


class ShiftedEps(LlamaRMSNorm):
    """Holds one epsilon and uses twice it: not the RMSNorm that rms_norm would compute, which shows only on inputs
    whose mean square is near epsilon."""

    def forward(self, hidden_states: Tensor) -> Tensor:
        x = hidden_states.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 2 * self.variance_epsilon)
        return self.weight * x.to(hidden_states.dtype)


class MeanCentred(LlamaRMSNorm):
    """A LayerNorm without bias wearing an RMSNorm's attributes."""

    def forward(self, hidden_states: Tensor) -> Tensor:
        x = hidden_states.float()
        x = x - x.mean(-1, keepdim=True)
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
        return self.weight * x.to(hidden_states.dtype)


class CentredShiftedEps(CohereLayerNorm):
    """A LayerNorm that holds one epsilon and uses twice it."""

    def forward(self, hidden_states: Tensor) -> Tensor:
        x = hidden_states.float()
        x = x - x.mean(-1, keepdim=True)
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 2 * self.variance_epsilon)
        return (self.weight.float() * x).to(hidden_states.dtype)


class BiasedCohereLayerNorm(CohereLayerNorm):
    """Cohere's LayerNorm with a bias added in float."""

    def __init__(self, hidden_size: int, eps: float = 1e-5) -> None:
        super().__init__(hidden_size, eps)
        self.bias = nn.Parameter(torch.zeros(hidden_size))

    def forward(self, hidden_states: Tensor) -> Tensor:
        x = hidden_states.float()
        mean = x.mean(-1, keepdim=True)
        variance = (x - mean).pow(2).mean(-1, keepdim=True)
        x = (x - mean) * torch.rsqrt(variance + self.variance_epsilon)
        return (self.weight.float() * x + self.bias.float()).to(hidden_states.dtype)


class CentredOnFourDims(LlamaRMSNorm):
    """An RMSNorm on rows and tokens that centres per-head inputs (``[batch, seq, heads, head_dim]``): which
    computation runs depends on the input's rank."""

    def forward(self, hidden_states: Tensor) -> Tensor:
        if hidden_states.dim() == 4:
            return MeanCentred.forward(self, hidden_states)
        return super().forward(hidden_states)


NORMS: dict[str, tuple[type[nn.Module], NormForm]] = {
    "llama": (LlamaRMSNorm, "weight"),
    "qwen3": (Qwen3RMSNorm, "weight"),
    "olmo2": (Olmo2RMSNorm, "weight_in_float"),
    "gemma": (GemmaRMSNorm, "one_plus_weight"),
    "cohere_layer_norm": (CohereLayerNorm, "layer_norm_in_float"),
    "layer_norm_with_bias": (BiasedCohereLayerNorm, "layer_norm_in_float"),
    "mean_centred": (MeanCentred, "layer_norm"),
}


@pytest.mark.parametrize("name", NORMS)
def test_transformers_norms_are_found_with_their_form(name: str) -> None:
    assert norm_form(_norm(name)) == NORMS[name][1]


@pytest.mark.parametrize(
    "module",
    [
        ShiftedEps(HIDDEN, eps=1e-10),
        CentredOnFourDims(HIDDEN),
        CentredShiftedEps(HIDDEN, eps=1e-10),
        nn.Linear(HIDDEN, HIDDEN),
        nn.Identity(),
    ],
    ids=["other_eps", "other_on_four_dims", "layer_norm_other_eps", "linear", "identity"],
)
def test_modules_that_compute_something_else_are_left_alone(module: nn.Module) -> None:
    assert norm_form(module) is None


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("weight_dtype", [torch.float32, torch.bfloat16], ids=["weight_fp32", "weight_bf16"])
@pytest.mark.parametrize("name", NORMS)
def test_fused_equals_the_module_forward_bit_for_bit_and_its_gradients(
    name: str, dtype: torch.dtype, weight_dtype: torch.dtype
) -> None:
    norm = _norm(name, weight_dtype)
    x = torch.randn(2, 37, HIDDEN).to(dtype).requires_grad_()
    upstream = torch.randn(2, 37, HIDDEN)

    expected = norm(x)
    expected_grads = torch.autograd.grad(expected, [x, *norm.parameters()], upstream.to(expected.dtype))
    got = _fused(norm, x, NORMS[name][1])
    got_grads = torch.autograd.grad(got, [x, *norm.parameters()], upstream.to(got.dtype))

    assert got.dtype == expected.dtype and torch.equal(got, expected)
    # fp32: the closed form against autograd's chain; bf16: autograd's chain rounds its intermediates to bf16
    tolerance = 1e-5 if dtype == weight_dtype == torch.float32 else 2e-2
    for g, e in zip(got_grads, expected_grads, strict=True):
        assert g.dtype == e.dtype
        assert ((g.float() - e.float()).norm() / e.float().norm()).item() < tolerance


@pytest.mark.cuda
@pytest.mark.parametrize("name", NORMS)
def test_fused_equals_the_module_on_cuda_in_bf16(name: str) -> None:
    norm = _norm(name, torch.bfloat16).cuda()
    x = torch.randn(2, 4096, HIDDEN, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    upstream = torch.randn(2, 4096, HIDDEN, device="cuda", dtype=torch.bfloat16)
    expected = norm(x)
    expected_grads = torch.autograd.grad(expected, [x, *norm.parameters()], upstream)
    got = _fused(norm, x, NORMS[name][1])
    got_grads = torch.autograd.grad(got, [x, *norm.parameters()], upstream)
    assert torch.equal(got, expected)
    for g, e in zip(got_grads, expected_grads, strict=True):
        assert ((g.float() - e.float()).norm() / e.float().norm()).item() < 2e-2


def _saved_bytes(fn: object, x: Tensor) -> int:
    """Bytes of the distinct storages autograd keeps for ``fn(x)``'s backward (parameters excluded)."""
    storages: dict[int, int] = {}

    def pack(t: Tensor) -> Tensor:
        if not isinstance(t, nn.Parameter):
            storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn(x)  # type: ignore[operator]
    return sum(storages.values())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_fused_keeps_only_the_input_and_the_reciprocal_rms(dtype: torch.dtype) -> None:
    norm = _norm("llama", dtype)
    x = torch.randn(4, 256, HIDDEN).to(dtype).requires_grad_()
    fused = _saved_bytes(lambda t: rms_norm(t, norm.weight, norm.variance_epsilon), x)
    plain = _saved_bytes(norm, x)
    rstd = 4 * 256 * 4
    assert fused == x.nbytes + rstd
    assert plain >= fused + 4 * x.numel()  # transformers' keeps at least the normalised tensor in float besides


def test_fused_norms_patch_every_rms_norm_of_a_model_and_undo() -> None:
    model = tiny_llama()
    norms = [m for m in model.modules() if isinstance(m, LlamaRMSNorm)]
    assert len(norms) == 2 * model.config.num_hidden_layers + 1
    ids = torch.randint(0, model.config.vocab_size, (2, 24))
    expected = model(ids).logits
    apply_memory_options(model, MemoryOptions(fused_norms=True))
    assert all("forward" in norm.__dict__ for norm in norms)
    assert torch.equal(model(ids).logits, expected)
    remove_memory_options(model)
    assert not any("forward" in norm.__dict__ for norm in norms)


def test_fused_layer_norm_keeps_only_the_input_and_per_token_statistics() -> None:
    norm = _norm("cohere_layer_norm", torch.bfloat16)
    x = torch.randn(4, 256, HIDDEN).to(torch.bfloat16).requires_grad_()
    fused = _saved_bytes(lambda t: layer_norm(t, norm.weight, None, norm.variance_epsilon), x)
    plain = _saved_bytes(norm, x)
    mean_and_rstd = 2 * 4 * 256 * 4
    assert fused == x.nbytes + mean_and_rstd
    assert plain >= fused + 4 * x.numel()  # Cohere's keeps float copies of the whole tensor besides


def test_torch_layer_norm_is_found_and_kept_as_it_is() -> None:
    """``nn.LayerNorm``'s kernel keeps only the input, the mean and the reciprocal standard deviation already."""
    for bias in (True, False):
        assert norm_form(nn.LayerNorm(HIDDEN, bias=bias)) == "native_layer_norm"
    model = tiny_recipe("starcoder2").build("eager")
    report = apply_memory_options(model, MemoryOptions(fused_norms=True))
    assert report.rows[0].applies == (
        "model.layers.*.input_layernorm (LayerNorm) x2, model.layers.*.post_attention_layernorm (LayerNorm) x2, "
        "model.norm (LayerNorm): torch's kernel, kept (it saves only the same)"
    )
    assert not any("forward" in m.__dict__ for m in model.modules())


@pytest.mark.parametrize("model_type", ["mamba2", "granitemoehybrid", "cohere"])
def test_fused_norms_train_gated_and_layer_norm_families_exactly(model_type: str) -> None:
    """Mamba 2's gated RMSNorm passes the probe without a gate and is called with one in training (the fused forward
    took no gate and crashed): its gated form is fused. Cohere's LayerNorms are fused."""
    model = tiny_recipe(model_type).build("eager").train()
    ids = torch.randint(1, 200, (2, 16))

    def logits_and_grads() -> tuple[Tensor, list[Tensor]]:
        logits = model(input_ids=ids).logits
        return logits, list(torch.autograd.grad(logits.float().logsumexp(-1).mean(), list(model.parameters())))

    expected, expected_grads = logits_and_grads()
    report = apply_memory_options(model, MemoryOptions(fused_norms=True))
    (row,) = report.rows
    gated = {type(m).__name__ for m in model.modules() if "Gated" in type(m).__name__}
    assert bool(gated) == (model_type != "cohere") and row.left_out == ()
    for name in gated | ({"CohereLayerNorm"} if model_type == "cohere" else set()):
        assert f"({name}) x2" in row.applies
    got, grads = logits_and_grads()
    assert torch.equal(got, expected)
    for g, e in zip(grads, expected_grads, strict=True):
        if e.norm() > 0:
            assert ((g - e).norm() / e.norm()).item() < 1e-5


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("group_size", [HIDDEN, HIDDEN // 4], ids=["one_group", "four_groups"])
def test_gated_norm_equals_mamba2s_bit_for_bit_and_keeps_less(group_size: int, dtype: torch.dtype) -> None:
    norm = _mamba2_gated_norm(group_size).to(dtype)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(HIDDEN))
    groups = gated_norm_groups(norm)
    assert groups == HIDDEN // group_size
    x, gate = (torch.randn(2, 37, HIDDEN).to(dtype).requires_grad_() for _ in range(2))
    upstream = torch.randn(2, 37, HIDDEN).to(dtype)
    for g in (gate, None):
        inputs = [x, norm.weight] + ([g] if g is not None else [])
        expected = norm(x, g)
        got = gated_rms_norm(x, g, norm.weight, norm.variance_epsilon, groups)
        assert torch.equal(got, expected)
        tolerance = 1e-5 if dtype == torch.float32 else 2e-2
        for a, e in zip(torch.autograd.grad(got, inputs, upstream), torch.autograd.grad(expected, inputs, upstream)):
            assert ((a.float() - e.float()).norm() / e.float().norm()).item() < tolerance
    fused = _saved_bytes(lambda t: gated_rms_norm(t, gate, norm.weight, norm.variance_epsilon, groups), x)
    assert fused == 2 * x.nbytes + 2 * 37 * groups * 4  # x, gate and the reciprocal RMS
    assert _saved_bytes(lambda t: norm(t, gate), x) >= fused + 4 * x.numel()


class GateAfterNorm(MambaRMSNormGated):
    """Gates after the norm (Falcon-H1's and Qwen3-Next's order): no gated form of ours, the ungated one is."""

    def forward(self, hidden_states: Tensor, gate: Tensor | None = None) -> Tensor:
        out = super().forward(hidden_states)
        return out if gate is None else out * torch.nn.functional.silu(gate)


def test_a_norm_called_with_a_gate_it_has_no_form_for_runs_its_own_forward() -> None:
    norm = _mamba2_gated_norm(HIDDEN, GateAfterNorm)
    assert norm_form(norm) == "weight" and gated_norm_groups(norm) is None
    x, gate = torch.randn(2, 5, HIDDEN), torch.randn(2, 5, HIDDEN)
    expected = norm(x, gate)
    fuse_norms([Norm("norm", norm, "weight")], Ledger())
    assert "forward" in norm.__dict__
    assert torch.equal(norm(x, gate), expected)  # its own forward
    assert torch.equal(norm(x), GateAfterNorm.forward(norm, x))  # fused, bit for bit


def test_fused_norms_without_a_norm_is_refused() -> None:
    model = tiny_llama()
    for layer in model.model.layers:
        layer.input_layernorm = layer.post_attention_layernorm = ShiftedEps(model.config.hidden_size)
    model.model.norm = ShiftedEps(model.config.hidden_size)
    with pytest.raises(ValueError, match="fused_norms found no RMSNorm or LayerNorm in LlamaForCausalLM"):
        apply_memory_options(model, MemoryOptions(fused_norms=True))
