"""Tokenizers for fine-tuning: a local Hugging Face folder, or the built-in byte-level chat tokenizer (no files)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from lightning_ulysses.data import _load_hf_tokenizer

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase, PreTrainedTokenizerFast

BYTE = "byte"
"""The ``tokenizer`` value that stands for :func:`byte_chat_tokenizer`."""

CHATML = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\n' }}"
    "{%- if message['role'] == 'assistant' %}"
    "{% generation %}{{- message['content'] + '<|im_end|>\n' }}{% endgeneration %}"
    "{%- else %}"
    "{{- message['content'] + '<|im_end|>\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\n' }}{%- endif %}"
)
"""ChatML (as Qwen's models use it) with the assistant's part, its end-of-turn token and newline included, marked
for ``return_assistant_tokens_mask``: what the model must write after ``<|im_start|>assistant\\n``."""


def byte_chat_tokenizer() -> PreTrainedTokenizerFast:
    """UTF-8 bytes as tokens (256 ids) plus ``<|pad|>``, ``<|im_start|>`` and ``<|im_end|>`` (also EOS): 259 ids, with
    the :data:`CHATML` template. Built in memory: nothing to download, every text encodable.

    Not :func:`~lightning_ulysses.data.byte_tokenizer` (``ByT5Tokenizer``): the assistant-only labels need the
    character offsets of a fast tokenizer (``return_assistant_tokens_mask``), which ByT5's Python tokenizer lacks.
    Its ids therefore differ from ByT5's (the 256 byte symbols in byte-level BPE's alphabet order, then the three
    special tokens); it saves with ``save_pretrained`` all the same."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    backend = Tokenizer(models.BPE(vocab={char: i for i, char in enumerate(alphabet)}, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    backend.decoder = decoders.ByteLevel()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        pad_token="<|pad|>",
        eos_token="<|im_end|>",
        additional_special_tokens=["<|im_start|>"],
    )
    tokenizer.chat_template = CHATML
    return tokenizer


def load_tokenizer(name: str) -> PreTrainedTokenizerBase:
    """:func:`byte_chat_tokenizer` for ``"byte"``, else the tokenizer saved in the local folder ``name``."""
    return byte_chat_tokenizer() if name == BYTE else _load_hf_tokenizer(name)
