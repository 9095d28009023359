"""The tiled loss computes the logits each model makes, scaled or soft-capped outside ``lm_head``, or refuses it.

``UlyssesStrategy(tiled_loss=...)`` runs ``lm_head`` per token tile on the decoder's final hidden states; families
that scale their logits (Granite's ``logits / logits_scaling``, Cohere's, Falcon-H1's and HyperCLOVAX's multipliers),
scale the hidden states before ``lm_head`` (MiniCPM3) or soft-cap the logits (Gemma 3n) get that map applied per tile,
as the set-up check finds it by running the model (:mod:`lightning_ulysses.hf.check.logits`); a model whose logits
follow otherwise is refused at set-up.

* One process: the classifier on constructed maps (identity, factors, soft-caps with and without a factor, in fp32
  and bf16, and six maps it must refuse); the tiles through a map equal the mapped logits (loss and gradient) without
  a host sync; the map the check finds for tiny models of each family (fp32 and bf16), whose tiled logits equal the
  model's own; a toy model with a per-token bias on its logits refused by ``check_tiled_logits``, and one that gives
  its decoder other inputs than the token ids (the decoder called by itself, as the tiled loss calls it, differs);
  without ``tiled_loss`` the check makes neither of its two logit calls (counted) and accepts that model; toy models
  loaded with ``from_pretrained`` that make their logits with a trainable tensor outside ``lm_head`` (a temperature,
  a soft-cap or a bias on the logits, a factor on the hidden states before ``lm_head``) refused by
  ``check_tiled_logits``, naming it (patched in inference mode as well), and the same models with the tensor frozen
  tiled exactly.
* Two processes (one launch): tiny Granite (``logits_scaling=4``), MiniCPM3 (ZeRO-3, tied embeddings), Falcon-H1
  (``lm_head_multiplier=0.3``) and Gemma 3n (final soft-cap 0.3) train one step with ``tiled_loss`` under
  ``UlyssesStrategy(sp_size=2)`` and equal one process of the plain model (loss rtol 1e-5, update 1e-4); their
  evaluation metrics before the step (a sanity validation) are the same from the tiled logits as from the model's own
  and equal the plain model's loss; a tiny Gemma 3 vision-language model trains two steps with ``tiled_loss``
  under ZeRO-3 as ``tests/test_vision.py`` checks it without; GPT-Neo, whose decoder ``sequence_mixers="gather"``
  runs on the whole sequence (gathered as the model calls it, ``input_ids`` by position; the tiled loss calls it by
  keyword), trains as one process; the toy model with a per-token bias is refused at set-up with ``tiled_loss``,
  before any validation or training step, and trains without it, its decoder never called by itself (neither by the
  set-up check nor by a loss); so is one with a trainable temperature on its logits (refused under ZeRO-3 as well),
  and one with it on the hidden states before ``lm_head`` is refused (the tiles would drop its gradient: with it
  taken as a constant the run would train every other weight as the plain model does and leave it where it was).
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.data import DataLoader
from transformers import LlamaConfig, LlamaForCausalLM
from transformers.modeling_outputs import CausalLMOutputWithPast

from lightning_ulysses import UlyssesLossMixin, UlyssesStrategy
from lightning_ulysses.hf import UnsupportedModelError, apply_ulysses_attention, remove_ulysses_attention, unpatched
from lightning_ulysses.hf.check.logits import check_tiled_logits, fit_output_map, spread_values, tiled_logit_map
from lightning_ulysses.logits import LogitMap, TiledLogits, token_losses
from lightning_ulysses.metrics import Perplexity, TokenAccuracy, TokenCrossEntropy
from lightning_ulysses.prediction import token_log_probs
from tests.cases import CaseTable
from tests.test_host_syncs import HostSyncs
from tests.tiny import collate, cpu_trainer, relative_update_error
from tests.zoo import LR, ROWS, build_model, make_samples, reference_step
from tests.zoo_configs import TinyRecipe, tiny_recipe

LOSS_RTOL, UPDATE_TOLERANCE = 1e-5, 1e-4


# ----------------------------------------------------------------------------------------------
# the classifier, one process
# ----------------------------------------------------------------------------------------------
def _x(dtype: torch.dtype = torch.float32) -> Tensor:
    return spread_values(torch.Size([2, 9, 50]), dtype, torch.device("cpu"))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    ("logits_of", "caps", "expected"),
    [
        (lambda x: x, [], LogitMap()),
        (lambda x: x / 4, [4.0], LogitMap(scale=0.25)),
        (lambda x: x * 0.0625, [], LogitMap(scale=0.0625)),
        (lambda x: torch.tanh(x / 30.0) * 30.0, [0.02, 30.0, 1e6], LogitMap(cap=30.0)),  # the config's cap
        (lambda x: torch.tanh(x / 30.0) * 30.0, [], LogitMap(cap=30.0)),  # the largest logit, where tanh saturates
        (lambda x: torch.tanh(x * 0.5 / 7.0) * 7.0, [7.0], LogitMap(scale=0.5, cap=7.0)),
    ],
    ids=["identity", "divided", "multiplied", "softcap_config", "softcap_saturated", "factor_then_softcap"],
)
def test_fit_output_map_finds_each_elementwise_map(logits_of, caps, expected: LogitMap, dtype: torch.dtype) -> None:
    x = _x(dtype)
    found = fit_output_map(x, logits_of(x), caps)
    assert isinstance(found, LogitMap), found
    rel = 1e-2 if dtype == torch.bfloat16 else 1e-6
    assert (found.cap is None) == (expected.cap is None)
    assert found.cap is None or found.cap == pytest.approx(expected.cap, rel=rel)
    assert found.scale == pytest.approx(expected.scale, rel=rel) and found.input_scale == 1
    ratio = found.head(lambda h: h)(x.float()) / logits_of(x).float()
    assert (ratio - 1).abs().max() < (2e-2 if dtype == torch.bfloat16 else 1e-5)


@pytest.mark.parametrize(
    ("logits_of", "seen"),
    [
        (lambda x: x + 0.05 * torch.arange(x.shape[1])[:, None], "closest factor (1)"),  # a per-token offset
        (lambda x: x + x.roll(1, dims=-1) * 1e-3, "no soft-cap"),  # mixes the logits of a token
        (lambda x: x**3, "no soft-cap"),
        (lambda x: torch.tanh(x / 30.0) * 30.0 + 1.0, "largest logit 31"),  # a soft-cap and more
        (lambda x: x[..., :-1], "shaped (2, 9, 49)"),
        (lambda x: torch.where(x > 0, x, -torch.inf), "not finite"),
    ],
    ids=["per_token_offset", "mixes_logits", "cubed", "softcap_plus_offset", "narrower", "masked"],
)
def test_fit_output_map_refuses_other_maps(logits_of, seen: str) -> None:
    x = _x()
    found = fit_output_map(x, logits_of(x), [30.0])
    assert isinstance(found, str) and seen in found, found


def test_tiles_through_a_map_equal_the_mapped_logits_and_never_sync_with_the_host() -> None:
    torch.manual_seed(0)
    lm_head = nn.Linear(16, 50, bias=False)
    hidden_states = torch.randn(2, 9, 16, requires_grad=True)
    labels = torch.randint(0, 50, (2, 9))
    logit_map = LogitMap(input_scale=0.5, scale=0.25, cap=0.7)  # the cap below the logits: it changes the loss
    expected = F.cross_entropy(
        (torch.tanh(0.25 * lm_head(0.5 * hidden_states) / 0.7) * 0.7).flatten(0, 1), labels.flatten(), reduction="sum"
    )
    expected_grad = torch.autograd.grad(expected, hidden_states)[0]
    syncs = HostSyncs()
    with syncs, syncs.methods_counted():
        loss = token_losses(TiledLogits(hidden_states, logit_map.head(lm_head), 4), labels).sum()
        grad = torch.autograd.grad(loss, hidden_states)[0]
    assert not syncs.counts, syncs.counts
    torch.testing.assert_close(loss, expected, rtol=1e-6, atol=0)
    torch.testing.assert_close(grad, expected_grad, rtol=1e-5, atol=1e-7)
    plain = F.cross_entropy(lm_head(hidden_states).flatten(0, 1), labels.flatten(), reduction="sum")
    assert not torch.isclose(plain, expected, rtol=1e-2)


# ----------------------------------------------------------------------------------------------
# what the set-up check finds for each family, one process
# ----------------------------------------------------------------------------------------------
FAMILIES: dict[str, tuple[str, dict[str, Any], LogitMap]] = {
    "llama": ("llama", {}, LogitMap()),
    "granite_logits_scaling4": ("granite", dict(logits_scaling=4.0), LogitMap(scale=0.25)),
    "granitemoe_logits_scaling3": ("granitemoe", dict(logits_scaling=3.0), LogitMap(scale=1 / 3)),
    "granitemoeshared_logits_scaling2": ("granitemoeshared", dict(logits_scaling=2.0), LogitMap(scale=0.5)),
    "granitemoehybrid_logits_scaling8": ("granitemoehybrid", dict(logits_scaling=8.0), LogitMap(scale=0.125)),
    "minicpm3": ("minicpm3", {}, LogitMap(input_scale=2.0)),  # hidden / logits_scaling (0.5) before lm_head
    "falcon_h1_lm_head_multiplier": ("falcon_h1", dict(lm_head_multiplier=0.3), LogitMap(scale=0.3)),
    "hyperclovax_logits_scaling": ("hyperclovax", dict(logits_scaling=0.7), LogitMap(scale=0.7)),
    "cohere_logit_scale": ("cohere", {}, LogitMap(scale=0.0625)),
    "gemma3n_softcap": ("gemma3n_text", {}, LogitMap(cap=30.0)),  # the default cap, far above the tiny logits
    # a cap below the tiny model's logits (at 30 they are nearly the same with and without it)
    "gemma3n_small_softcap": ("gemma3n_text", dict(final_logit_softcapping=0.3), LogitMap(cap=0.3)),
    # a vision-language model (its language model is the decoder) whose text config names a soft-cap that its
    # forward does not apply: refused by that name before, tiled as it computes now
    "gemma3_vlm_unused_softcap": ("gemma3", dict(final_logit_softcapping=0.3), LogitMap()),
}


def _recipe(model_type: str, config: dict[str, Any]) -> TinyRecipe:
    recipe = tiny_recipe(model_type)
    text_config = recipe.config.get_text_config()
    for key, value in config.items():
        setattr(text_config, key, value)
    return recipe


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name", list(FAMILIES))
def test_check_finds_each_family_map_and_tiles_equal_its_logits(name: str, dtype: torch.dtype) -> None:
    model_type, config, expected = FAMILIES[name]
    recipe = _recipe(model_type, config)
    model = build_model(recipe)[0].to(dtype)  # bf16: the constants fitted to its rounded logits are the config's
    apply_ulysses_attention(model, group=None, attn_implementation="sdpa")
    try:
        found = tiled_logit_map(model)
        assert found.input_scale == pytest.approx(expected.input_scale, rel=1e-6)
        assert found.scale == pytest.approx(expected.scale, rel=1e-6)
        assert found.cap == expected.cap
        ids = torch.tensor(recipe.token_ids)[torch.arange(2 * 13).view(2, 13) % len(recipe.token_ids)]
        positions = torch.arange(13).expand(2, -1)
        with torch.no_grad(), unpatched(model):
            expected_logits = model(input_ids=ids, position_ids=positions).logits
            hidden_states = model.get_decoder()(input_ids=ids, position_ids=positions).last_hidden_state
            tiled = found.head(model.get_output_embeddings())(hidden_states)
            plain = model.get_output_embeddings()(hidden_states)
        rtol, atol = (1e-5, 1e-6) if dtype == torch.float32 else (1.6e-2, 1e-2)  # bf16: an ulp, as kernels round
        torch.testing.assert_close(tiled, expected_logits, rtol=rtol, atol=atol)
        if found != LogitMap() and name != "gemma3n_softcap":  # the map matters: lm_head alone would be wrong
            assert not torch.allclose(plain, expected_logits, rtol=1e-3, atol=0)
    finally:
        remove_ulysses_attention(model)


class TokenBiasedLlama(LlamaForCausalLM):
    """A toy causal LM that adds a bias vector chosen by each token's id to its logits: not a map of ``lm_head``'s
    output alone, so no tile of ``lm_head`` can give its logits."""

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__(config)
        self.token_bias = nn.Embedding(config.vocab_size, config.vocab_size)

    def forward(self, input_ids: Tensor | None = None, **kwargs: Any) -> Any:
        output = super().forward(input_ids=input_ids, **kwargs)
        output.logits = output.logits + self.token_bias(input_ids)
        return output


def token_biased_llama() -> TokenBiasedLlama:
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        attn_implementation="sdpa",
    )
    return TokenBiasedLlama(config)


def test_check_tiled_logits_refuses_a_per_token_bias() -> None:
    model = token_biased_llama()
    apply_ulysses_attention(model, group=None, attn_implementation="sdpa")  # without tiled_loss the model is accepted
    try:
        with pytest.raises(UnsupportedModelError, match=r"(?i)TokenBiasedLlama .*set tiled_loss=False"):
            check_tiled_logits(nn.ModuleDict({"model": model}))
        with pytest.raises(UnsupportedModelError, match="other than element-wise"):
            tiled_logit_map(model)
    finally:
        remove_ulysses_attention(model)


class EmbeddingScaledLlama(LlamaForCausalLM):
    """A toy causal LM that gives its decoder its token embeddings doubled: the decoder called by itself on the token
    ids (as the tiled loss calls it) computes other hidden states than inside the model."""

    def forward(self, input_ids: Tensor | None = None, **kwargs: Any) -> Any:
        return super().forward(inputs_embeds=2 * self.model.embed_tokens(input_ids), **kwargs)


def test_check_tiled_logits_refuses_a_decoder_that_differs_when_called_by_itself() -> None:
    torch.manual_seed(0)
    model = EmbeddingScaledLlama(token_biased_llama().config)
    apply_ulysses_attention(model, group=None, attn_implementation="sdpa")  # without tiled_loss the model is accepted
    try:
        with pytest.raises(
            UnsupportedModelError, match=r"(?i)its decoder \(model\), called by itself .*set tiled_loss=False"
        ):
            check_tiled_logits(nn.ModuleDict({"model": model}))
    finally:
        remove_ulysses_attention(model)


class LearnedLogitsLlama(LlamaForCausalLM):
    """A toy causal LM that makes its logits from ``lm_head``'s output with a trainable tensor, ``logits_parameter``,
    as ``config.learned_logits`` says: a temperature multiplying them (``"scale"``, 0.5), a soft-cap (``"cap"``,
    0.5), a bias added to them (``"bias"``, zeros: at first the logits are ``lm_head``'s own), a factor on the
    decoder's final hidden states before ``lm_head`` (``"input_scale"``, 0.5), or a gain on the input embeddings
    that the forward hands its decoder (``"embedding_gain"``, 1: at first the decoder called by itself computes the
    same). At its present value each is a map that the tiles could apply as a constant; in training it moves as its
    gradient says."""

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__(config)
        bias, gain = config.learned_logits == "bias", config.learned_logits == "embedding_gain"
        self.logits_parameter = nn.Parameter(
            torch.zeros(config.vocab_size) if bias else torch.full((1,), 1.0 if gain else 0.5)
        )

    def forward(
        self, input_ids: Tensor | None = None, position_ids: Tensor | None = None, **kwargs: Any
    ) -> CausalLMOutputWithPast:
        learned, parameter = self.config.learned_logits, self.logits_parameter
        if learned == "embedding_gain":
            kwargs["inputs_embeds"] = self.model.embed_tokens(input_ids) * parameter
            input_ids = None
        hidden_states = self.model(input_ids=input_ids, position_ids=position_ids, **kwargs).last_hidden_state
        if learned == "input_scale":
            hidden_states = hidden_states * parameter
        logits = self.lm_head(hidden_states)
        if learned == "scale":
            logits = logits * parameter
        elif learned == "cap":
            logits = parameter * torch.tanh(logits / parameter)
        elif learned == "bias":
            logits = logits + parameter
        return CausalLMOutputWithPast(logits=logits)


def learned_logits_llama(learned: str) -> LearnedLogitsLlama:
    config = token_biased_llama().config
    config.learned_logits = learned
    torch.manual_seed(0)
    return LearnedLogitsLlama(config)


LEARNED_MAPS = {  # the map the tiles apply once the tensor is frozen, and where it joins
    "scale": (LogitMap(scale=0.5), "lm_head's output to its logits"),
    "cap": (LogitMap(cap=0.5), "lm_head's output to its logits"),
    "bias": (LogitMap(), "lm_head's output to its logits"),
    "input_scale": (LogitMap(input_scale=0.5), "its decoder's final hidden states to lm_head's input"),
    "embedding_gain": (LogitMap(), "its input to its decoder's"),
}


@pytest.mark.parametrize("learned", list(LEARNED_MAPS))
def test_check_tiled_logits_refuses_a_trainable_tensor_outside_lm_head(learned: str, tmp_path: Path) -> None:
    """A model loaded with ``from_pretrained`` that scales, soft-caps or biases its logits with a trainable tensor, or
    scales the hidden states before ``lm_head`` or the input embeddings it hands its decoder by one, is refused with
    ``tiled_loss``, naming the tensor: the tiles would apply its present value as a constant (the gain's, 1, as the
    decoder called by itself does) and leave its gradient out. Frozen, the same tensor is a constant, which the tiles
    apply (their logits equal the model's own). No gradient is made."""
    learned_logits_llama(learned).save_pretrained(tmp_path)
    model = LearnedLogitsLlama.from_pretrained(tmp_path, attn_implementation="sdpa")
    expected_map, stretch = LEARNED_MAPS[learned]
    shape = (64,) if learned == "bias" else (1,)
    apply_ulysses_attention(model, group=None, attn_implementation="sdpa", tiled_loss=True)
    try:
        with pytest.raises(
            UnsupportedModelError,
            match=rf"LearnedLogitsLlama cannot .* from {re.escape(stretch)} it computes with tensors that need a "
            rf"gradient: logits_parameter {re.escape(str(shape))}, .*gradients out\..*Set tiled_loss=False",
        ):
            check_tiled_logits(nn.ModuleDict({"model": model}), fused_training=True)
        assert all(p.grad is None for p in model.parameters())
    finally:
        remove_ulysses_attention(model)
    model.logits_parameter.requires_grad_(False)
    apply_ulysses_attention(model, group=None, attn_implementation="sdpa", tiled_loss=True)
    try:
        assert tiled_logit_map(model) == expected_map
        ids = torch.arange(26).view(2, 13)
        with torch.no_grad(), unpatched(model):
            hidden_states = model.get_decoder()(input_ids=ids).last_hidden_state
            torch.testing.assert_close(
                expected_map.head(model.get_output_embeddings())(hidden_states),
                model(input_ids=ids).logits,
                rtol=1e-5,
                atol=1e-6,
            )
    finally:
        remove_ulysses_attention(model)


def test_the_trainable_tensor_is_found_where_the_model_is_patched_in_inference_mode() -> None:
    """Patched inside ``torch.inference_mode()`` (for evaluation, say), the check still records the graph it reads and
    names the tensor (not a failure of the forward to save an inference tensor for the backward)."""
    model = learned_logits_llama("scale")
    with torch.inference_mode():
        apply_ulysses_attention(model, group=None, attn_implementation="sdpa", tiled_loss=True)
    try:
        with pytest.raises(UnsupportedModelError, match=r"need a gradient: logits_parameter \(1,\)"):
            tiled_logit_map(model)
    finally:
        remove_ulysses_attention(model)


class ForwardCounts:
    """Counts the forwards of a model and the calls of its decoder outside one (the decoder called by itself, as the
    tiled loss and step 7 of the set-up check call it)."""

    def __init__(self, model: nn.Module) -> None:
        self.forwards = self.decoder_alone = self._depth = 0
        model.register_forward_pre_hook(self._enter)
        model.register_forward_hook(self._leave, always_call=True)
        model.get_decoder().register_forward_pre_hook(self._decoder)

    def _enter(self, module: nn.Module, args: Any) -> None:
        self.forwards += 1
        self._depth += 1

    def _leave(self, module: nn.Module, args: Any, output: Any) -> None:
        self._depth -= 1

    def _decoder(self, module: nn.Module, args: Any) -> None:
        self.decoder_alone += self._depth == 0


def test_the_check_reads_the_logits_only_with_tiled_loss() -> None:
    """Without ``tiled_loss`` the set-up check makes neither its plain forward with ``lm_head``'s output replaced nor
    its call of the decoder by itself, and a model whose decoder differs when called by itself is accepted (it trains
    with its own logits); with it, that model is refused by what those two calls see."""
    counts = {}
    for tiled_loss in (False, True):
        torch.manual_seed(0)
        model = EmbeddingScaledLlama(token_biased_llama().config)
        counts[tiled_loss] = ForwardCounts(model)
        apply_ulysses_attention(model, group=None, core="sdpa", tiled_loss=tiled_loss)
        try:
            if tiled_loss:
                with pytest.raises(UnsupportedModelError, match=r"its decoder \(model\), called by itself"):
                    check_tiled_logits(nn.ModuleDict({"model": model}))
            else:
                with pytest.raises(RuntimeError, match="patched with tiled_loss off, so the set-up check did not"):
                    tiled_logit_map(model)
        finally:
            remove_ulysses_attention(model)
    off, on = counts[False], counts[True]
    assert (off.decoder_alone, on.decoder_alone) == (0, 1)
    assert on.forwards - off.forwards == 1 and off.forwards > 0


# ----------------------------------------------------------------------------------------------
# training and evaluation with tiled_loss under UlyssesStrategy(sp_size=2), one launch
# ----------------------------------------------------------------------------------------------
CASES: dict[str, dict[str, Any]] = {
    "granite_logits_scaling4": dict(model_type="granite", config=dict(logits_scaling=4.0), stage=2),
    # tied embeddings under ZeRO-3
    "minicpm3_hidden_scaled_zero3": dict(model_type="minicpm3", stage=3),
    "falcon_h1_lm_head_multiplier": dict(model_type="falcon_h1", config=dict(lm_head_multiplier=0.3), stage=2),
    # a cap below the tiny model's logits, so that a loss without it would differ
    "gemma3n_softcap": dict(model_type="gemma3n_text", config=dict(final_logit_softcapping=0.3), stage=2),
    # a vision-language model: the tiled loss of its language model's hidden states, images merged on each shard
    "gemma3_vision_language_zero3": dict(family="gemma3", sp=2, stage=3),
    # a family exact only with sequence_mixers="gather" (its local attention's mask runs on the whole sequence)
    "gpt_neo_gathered": dict(model_type="gpt_neo", stage=2, sequence_mixers="gather"),
    "token_bias_refused": dict(model_type="token_biased_llama", stage=2, refused="TokenBiasedLlama"),
    "token_bias_untiled": dict(model_type="token_biased_llama", stage=2, tiled_loss=False),
    # a trainable temperature on the logits, or on the hidden states before lm_head: refused (the tiles would drop its
    # gradient), under ZeRO-3 too, where the set-up check's forwards gather the parameters through DeepSpeed's hooks
    "learned_scale_refused_zero3": dict(
        model_type="learned_logits_llama",
        learned="scale",
        stage=3,
        refused=r"lm_head's output to its logits .*: logits_parameter \(1,\),",
    ),
    "learned_input_scale_refused": dict(
        model_type="learned_logits_llama",
        learned="input_scale",
        stage=2,
        refused=r"to lm_head's input .*: logits_parameter \(1,\),",
    ),
    "learned_scale_untiled": dict(model_type="learned_logits_llama", learned="scale", stage=2, tiled_loss=False),
}


def _model(case: dict[str, Any]) -> nn.Module:
    if case["model_type"] == "token_biased_llama":
        return token_biased_llama()
    if case["model_type"] == "learned_logits_llama":
        return learned_logits_llama(case["learned"])
    return build_model(_recipe(case["model_type"], case.get("config", {})))[0]


def _samples(case: dict[str, Any]) -> list[dict[str, Tensor]]:
    """The zoo's data: 2 rows of 32 token ids, labels -100 across the shard border."""
    if case["model_type"] in ("token_biased_llama", "learned_logits_llama"):
        return make_samples(list(range(64)))
    return make_samples(_recipe(case["model_type"], case.get("config", {})).token_ids)


class TiledLossModule(UlyssesLossMixin, L.LightningModule):
    """Trains with :meth:`forward_causal_lm_loss` (tiled under the strategy's ``tiled_loss``); its validation updates
    each metric from :meth:`causal_lm_logits` and from the model's own logits, and keeps the sanity check's values."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model
        self.steps_started = 0
        self.losses: list[float] = []
        kinds = ("tiled", "own")
        self.metrics = nn.ModuleDict(
            {f"{k}_{m.__name__}": m() for k in kinds for m in (TokenCrossEntropy, Perplexity, TokenAccuracy)}
        )
        self.evaluation: dict[str, float] = {}
        self.log_prob_error = 0.0
        self.logits_kinds: set[str] = set()

    def training_step(self, batch: dict[str, Tensor], batch_idx: int) -> Tensor:
        self.steps_started += 1
        loss = self.forward_causal_lm_loss(self.model, batch)
        self.losses.append(loss.item())
        return loss

    def validation_step(self, batch: dict[str, Tensor], batch_idx: int) -> None:
        self.steps_started += 1
        labels = batch["shift_labels"]
        logits = {
            "tiled": self.causal_lm_logits(self.model, batch),
            "own": self.model(**self.model_inputs(self.model, batch)).logits,
        }
        self.logits_kinds.add(type(logits["tiled"]).__name__)
        for name, metric in self.metrics.items():
            metric.update(logits[name.split("_")[0]], labels)
        tiled, own = (token_log_probs(logits[k], labels) for k in ("tiled", "own"))
        self.log_prob_error = max(self.log_prob_error, ((tiled - own).abs().max() / own.abs().max()).item())

    def on_validation_epoch_end(self) -> None:
        if self.trainer.sanity_checking:  # on the initial weights, as the reference's loss
            self.evaluation = {name: metric.compute().item() for name, metric in self.metrics.items()}
        for metric in self.metrics.values():
            metric.reset()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=LR)


def fit_case(name: str, case: dict[str, Any], world_size: int) -> dict[str, Any]:
    import deepspeed

    if "family" in case:
        return fit_vision_case(case, world_size)
    module = TiledLossModule(_model(case))
    counts = ForwardCounts(module.model)
    strategy = UlyssesStrategy(
        sp_size=world_size,
        stage=case["stage"],
        attn_implementation="sdpa",
        tiled_loss=case.get("tiled_loss", 3),
        sequence_mixers=case.get("sequence_mixers", "refuse"),
    )
    trainer = cpu_trainer(world_size, strategy, max_steps=1, num_sanity_val_steps=1)
    loader = DataLoader(_samples(case), batch_size=ROWS, collate_fn=collate)
    try:
        trainer.fit(module, loader, loader)
    except UnsupportedModelError as error:
        return {"refused": str(error), "steps_started": module.steps_started, "decoder_alone": counts.decoder_alone}
    with deepspeed.zero.GatheredParameters(list(module.model.parameters()), enabled=case["stage"] == 3):
        params = {n: p.detach().clone() for n, p in module.model.named_parameters()}
    return {
        "losses": module.losses,
        "params": params,
        "evaluation": module.evaluation,
        "log_prob_error": module.log_prob_error,
        "logits_kinds": module.logits_kinds,
        "decoder_alone": counts.decoder_alone,
    }


def fit_vision_case(case: dict[str, Any], world_size: int) -> dict[str, Any]:
    """``tests.test_vision``'s training of a tiny vision-language model, with ``tiled_loss``."""
    from tests.test_vision import CONFIGS, STEPS, SGDVisionLanguageModel, case_batches, tiny_model
    from tests.tiny import gathered_parameters

    class Recorded(SGDVisionLanguageModel):
        def causal_lm_logits(self, model: Any, batch: Any) -> Any:
            logits = super().causal_lm_logits(model, batch)
            self.logits_kinds.add(type(logits).__name__)
            return logits

    module = Recorded(model=CONFIGS[case["family"]])
    module.model, module.losses, module.logits_kinds = tiny_model(case["family"]), [], set()
    trainer = cpu_trainer(
        world_size,
        UlyssesStrategy(sp_size=case["sp"], stage=case["stage"], attn_implementation="sdpa", tiled_loss=3),
        max_steps=STEPS,
        num_sanity_val_steps=0,
    )
    trainer.fit(module, DataLoader(case_batches(case), batch_size=1, collate_fn=lambda items: items[0]))
    params = gathered_parameters(module.model, case["stage"] == 3)
    return {"losses": module.losses, "params": params, "logits_kinds": module.logits_kinds}


TABLE = CaseTable("tiled_loss_results", "tests.test_tiled_loss_transforms:fit_case", 2, CASES)
tiled_loss_results = TABLE.fixture()


@pytest.mark.distributed
@TABLE.each_case
def test_tiled_loss_equals_one_process(tiled_loss_results: list[dict[str, Any]], name: str) -> None:
    case = CASES[name]
    if "refused" in case:
        for result in tiled_loss_results:
            got = result[name]
            assert got.get("steps_started") == 0, "refused at set-up, before any validation or training step"
            assert re.search(case["refused"], got["refused"]) and "Set tiled_loss=False" in got["refused"], got
        return
    if "family" in case:
        from tests.test_vision import check_against_reference

        assert all(result[name]["logits_kinds"] == {"TiledLogits"} for result in tiled_loss_results)
        check_against_reference(name, case, tiled_loss_results)
        return
    model = _model(case)
    initial = {n: p.detach().clone() for n, p in model.named_parameters()}
    expected_loss, expected = reference_step(model, collate(_samples(case)))
    for rank, result in enumerate(tiled_loss_results):
        got = result[name]
        assert "refused" not in got, got.get("refused")
        assert got["logits_kinds"] == {"TiledLogits" if case.get("tiled_loss", 3) else "Tensor"}
        # the decoder by itself: the set-up check's step 7 and the tiled loss, with tiled_loss only
        assert (got["decoder_alone"] > 0) == bool(case.get("tiled_loss", 3)), got["decoder_alone"]
        torch.testing.assert_close(torch.tensor(got["losses"]), expected_loss[None], rtol=LOSS_RTOL, atol=0)
        error = relative_update_error(initial, expected, got["params"])
        assert error < UPDATE_TOLERANCE, f"{name} rank {rank}: relative weight-update error {error:.2e}"
        evaluation = got["evaluation"]
        for metric in ("TokenCrossEntropy", "Perplexity", "TokenAccuracy"):
            assert evaluation[f"tiled_{metric}"] == pytest.approx(evaluation[f"own_{metric}"], rel=1e-5), metric
        # the sanity validation runs on the initial weights: its loss is the plain model's
        assert evaluation["tiled_TokenCrossEntropy"] == pytest.approx(expected_loss.item(), rel=LOSS_RTOL)
        assert got["log_prob_error"] < 1e-5
