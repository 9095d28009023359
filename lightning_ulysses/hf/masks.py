"""What attention pattern a transformers model asks for, read from the mask functions it builds.

Transformers expresses every attention pattern as a *mask function* ``f(batch, head, q_idx, kv_idx) -> bool``
composed from a few overlays (causal, sliding window, chunks, padding, packed sequences, model-specific
and/or functions) and hands it to a mask interface (``ALL_MASK_ATTENTION_FUNCTIONS[implementation]``),
which materialises it. Some families apply their sliding window *only* there (Qwen2-MoE with
``use_sliding_window``, PhiMoE), so an attention function that ignores the mask would drop it.

Ulysses attention runs three patterns, all O(N) (documents come from the position ids):

* ``causal``: a query sees itself and every earlier token of its document;
* ``window=w``: ... and only the ``w - 1`` tokens before it (transformers' ``sliding_window``);
* ``chunk=c``: ... and only tokens of its chunk (``position // c``, Llama4's ``attention_chunk_size``).

:func:`recording_mask_interface` is registered as the ``"ulysses"`` mask interface while the set-up check
(:mod:`lightning_ulysses.hf.check`) runs its short forward: it materialises transformers' own mask and
identifies the pattern from the mask function, evaluated on index pairs around the window or chunk size
(so a window of 128k tokens is read exactly from a probe of a few tokens). During training the interface
is not registered: transformers then builds no ``[N, N]`` mask at all.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor
from transformers.masking_utils import sdpa_mask

from lightning_ulysses.attention.core import no_window_if_off

MaskFunction = Callable[[Tensor, Tensor, Tensor, Tensor], Tensor]


@dataclass(frozen=True)
class MaskPattern:
    """A causal attention pattern that Ulysses attention computes exactly (see the module docstring)."""

    window: int | None = None
    chunk: int | None = None
    spans: bool = False
    """The runs of ``token_type_ids == 1`` (image tokens) attend to each other both ways (Gemma 3; see
    :mod:`lightning_ulysses.attention.spans`), as read by :func:`~lightning_ulysses.hf.check.spans.check_spans`."""

    def allows(self, q_idx: Tensor, kv_idx: Tensor, span_ids: Tensor | None = None) -> Tensor:
        """Whether query index ``q_idx`` may attend key index ``kv_idx`` (broadcast bool tensor); with ``spans``,
        ``span_ids [N]`` numbers each token's span (``-1``: none)."""
        allowed = kv_idx <= q_idx
        if self.spans:
            assert span_ids is not None
            allowed = allowed | ((span_ids[q_idx] == span_ids[kv_idx]) & (span_ids[q_idx] >= 0))
        if self.window is not None:
            allowed = allowed & (q_idx - kv_idx < self.window)
        if self.chunk is not None:
            allowed = allowed & (q_idx // self.chunk == kv_idx // self.chunk)
        return allowed

    def describe(self) -> str:
        spans = ", image spans bidirectional" if self.spans else ""
        if self.window is not None:
            return f"sliding window of {self.window} tokens{spans}"
        if self.chunk is not None:
            return f"chunks of {self.chunk} tokens{spans}"
        return f"causal{spans}"


def identify_pattern(
    mask: Tensor,
    mask_function: MaskFunction,
    local_size: int | None,
    q_offset: int,
    kv_offset: int,
    index_based: bool,
) -> MaskPattern | None:
    """The :class:`MaskPattern` that transformers' materialised ``mask`` ``[B, 1, q, kv]`` and its
    ``mask_function`` express, or ``None`` when it is none of them.

    ``local_size`` is the window or chunk size transformers passes with sliding and chunked masks (``None`` or ``0``:
    none; Qwen2-MoE builds its sliding mask with a window of 0 when ``use_sliding_window=False``). When
    ``index_based`` (no model-specific mask functions, so ``mask_function`` reads nothing but the indices) the
    candidates are also checked at index pairs around ``local_size``, which the short probe cannot reach.
    """
    local_size = no_window_if_off(local_size)
    candidates = [MaskPattern()]
    if local_size is not None:
        candidates += [MaskPattern(window=local_size), MaskPattern(chunk=local_size)]
    device = mask.device
    q_idx = torch.arange(mask.shape[-2], device=device)[:, None] + q_offset
    kv_idx = torch.arange(mask.shape[-1], device=device)[None, :] + kv_offset
    matches = [c for c in candidates if bool((c.allows(q_idx, kv_idx) == mask).all())]
    if local_size is None or not index_based:
        # without the index pairs beyond the probe, a window or chunk longer than it looks causal: refuse that
        return matches[0] if len(matches) == 1 else None
    q_far, kv_far = _index_pairs_around(local_size, device)
    zeros = torch.zeros_like(q_far)
    expected = mask_function(zeros, zeros, q_far, kv_far).to(torch.bool)
    matches = [c for c in matches if bool((c.allows(q_far, kv_far) == expected).all())]
    return matches[0] if len(matches) == 1 else None


def _index_pairs_around(size: int, device: torch.device) -> tuple[Tensor, Tensor]:
    """``(q_idx, kv_idx)`` pairs that tell causal, a window of ``size`` and chunks of ``size`` apart."""
    pairs = []
    for q in (size - 1, size, size + 1, 2 * size - 1, 2 * size, 2 * size + 1, 3 * size + 2):
        for kv in (q + 1, q, q - 1, q - size + 2, q - size + 1, q - size, q - size - 1, q - 2 * size, 0):
            if kv >= 0 and q >= 0:
                pairs.append((q, kv))
    index = torch.tensor(pairs, device=device)
    return index[:, 0], index[:, 1]


@dataclass
class RecordedMasks:
    """The masks materialised by :func:`recording_mask_interface` during one probe forward, with their patterns."""

    masks: list[tuple[Tensor, MaskPattern | None]]

    def pattern_of(self, received: Tensor | None, window: int | None = None) -> tuple[MaskPattern | None, str]:
        """The pattern of the mask an attention layer received, or ``None`` and why it is not one we run.

        Masks of different patterns can be equal on the probe's few tokens (a sliding window longer than the probe
        is causal there): the recorded mask that is the very tensor received is its pattern; failing that, among
        those equal to it, the one built with the ``window`` the layer passes (its ``sliding_window``), else the
        first."""
        if received is None:
            return MaskPattern(), ""  # no mask: transformers' kernels then attend causally
        allowed, why = allowed_keys(received)
        if allowed is None:
            return None, why
        same = [pattern for mask, pattern in self.masks if mask is received]
        equal = same or [
            pattern
            for mask, pattern in self.masks
            if allowed.shape[-2:] == mask.shape[-2:] and bool((allowed == mask).all())
        ]
        if not equal:
            return None, "receives an attention mask that the model changed after transformers built it"
        window = no_window_if_off(window)
        pattern = next((p for p in equal if p is not None and p.window == window), equal[0])
        if pattern is None:
            return None, "receives an attention mask pattern other than causal, sliding-window or chunked"
        return pattern, ""


def allowed_keys(received: Any) -> tuple[Tensor | None, str]:
    """The bool ``[B, 1, q, kv]`` pattern of an attention mask as a layer received it (bool, or additive with
    ``0`` / ``-inf`` entries), or ``None`` and why it is not a pattern."""
    if not isinstance(received, Tensor):
        return None, f"receives an attention mask of type {type(received).__name__}"
    if received.dtype == torch.bool:
        return received, ""
    blocked = received <= torch.finfo(received.dtype).min / 2
    if not bool(((received == 0) | blocked).all()):
        return None, "adds a bias to its attention scores through the attention mask"
    return received == 0, ""


def recording_mask_interface(recorded: RecordedMasks) -> Callable[..., Tensor]:
    """A transformers mask interface that materialises the mask as SDPA's does and records its pattern."""

    def interface(
        batch_size: int,
        q_length: int,
        kv_length: int,
        q_offset: int = 0,
        kv_offset: int = 0,
        mask_function: MaskFunction | None = None,
        attention_mask: Tensor | None = None,
        local_size: int | None = None,
        use_vmap: bool = False,
        device: Any = "cpu",
        **kwargs: Any,
    ) -> Tensor:
        options: dict[str, Any] = dict(mask_function=mask_function) if mask_function is not None else {}
        mask = sdpa_mask(
            batch_size=batch_size,
            q_length=q_length,
            kv_length=kv_length,
            q_offset=q_offset,
            kv_offset=kv_offset,
            attention_mask=attention_mask,
            local_size=local_size,
            allow_is_causal_skip=False,
            use_vmap=use_vmap,
            device=device,
            **options,
        )
        assert mask is not None  # neither skip allowed (causal, bidirectional): sdpa_mask builds the mask whole
        function = mask_function if mask_function is not None else (lambda b, h, q, kv: kv <= q)
        index_based = not use_vmap and attention_mask is None
        pattern = identify_pattern(mask, function, local_size, q_offset, kv_offset, index_based)
        recorded.masks.append((mask, pattern))
        return mask

    return interface
