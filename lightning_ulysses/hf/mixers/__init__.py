"""Token mixers other than attention: short convolutions, linear attention, state-space layers.

* :mod:`.kernels`, :mod:`.core`, :mod:`.hook`, :mod:`.lightning`, :mod:`.rglru`, :mod:`.mlstm`: the Ulysses form.
  The sequential kernels that transformers' hybrid models call (depthwise causal convolutions, Mamba / Mamba2 scans,
  gated and Kimi delta rules, RWKV's WKV), MiniMax's lightning attention, RecurrentGemma's convolution + RG-LRU and
  xLSTM's mLSTM backend run on the whole sequence for this rank's heads or channels, between two all-to-alls, as
  attention does; installed on every mixer that calls them (:func:`sharded_mixer_forward`), with packed documents cut
  into rows of their own. :mod:`.shift`: token shifts (RWKV's ``time_shift``) take the tokens before each shard from
  the rank holding them (a halo, no all-to-all), resetting at document starts. :mod:`.cca`: ZAYA's CCA projection,
  its q|k convolutions head-sharded, its delayed values shifted.
* :mod:`.gather`: the opt-in fallback for any other mixer (``sequence_mixers="gather"``): the module runs on the
  whole sequence on every rank.
"""

from lightning_ulysses.hf.mixers.core import plan_document_rows
from lightning_ulysses.hf.mixers.gather import gather_whole_sequence
from lightning_ulysses.hf.mixers.hook import (
    is_token_mixer,
    kernels_called,
    register_mixer_weights_for_zero3,
    sharded_mixer_forward,
)
from lightning_ulysses.hf.mixers.kernels import KERNELS, KernelSpec
from lightning_ulysses.hf.mixers.shift import shift_sequence
from lightning_ulysses.hf.plan import TokenDims

__all__ = [
    "KERNELS",
    "KernelSpec",
    "TokenDims",
    "gather_whole_sequence",
    "is_token_mixer",
    "kernels_called",
    "plan_document_rows",
    "register_mixer_weights_for_zero3",
    "sharded_mixer_forward",
    "shift_sequence",
]
