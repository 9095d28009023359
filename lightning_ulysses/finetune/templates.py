"""Records -> ``input_ids`` and ``labels`` that are ``-100`` everywhere but on the tokens the assistant writes.

Two record shapes (TRL's names):

* conversational: ``{"messages": [{"role": ..., "content": ...}, ...]}``, or ``{"prompt": [messages],
  "completion": [messages]}``. The tokenizer's chat template renders the conversation; the labelled characters
  are the template's ``{% generation %}`` blocks when it has them, otherwise what the template adds for each
  assistant message after the generation prompt (``render(messages[:i], add_generation_prompt=True)`` up to
  ``render(messages[:i + 1])``). In a prompt/completion record only the completion's assistant turns are labelled.
* plain: ``{"prompt": str, "completion": str}``: no template; ``prompt + completion`` with the tokenizer's special
  tokens, the completion and an end-of-sequence token labelled.

Characters become tokens exactly: every border of a labelled span must be a token border of the whole text,
verified by tokenizing the text up to the border and finding those tokens at the start of the whole text's
tokens. A template or tokenizer that merges characters across a border (or renders earlier turns differently
once later turns follow) is refused with :class:`TemplateError`: its labels would not be where the assistant's
tokens are, nor would training see the tokens that inference sees after the same prompt.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, cast

from lightning_ulysses.sharding import IGNORE_INDEX

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

Message = Mapping[str, Any]
GENERATION_TAG = re.compile(r"\{%-?\s*generation\s*-?%\}")


class TemplateError(ValueError):
    """The assistant's tokens cannot be located exactly in a record's tokens."""


def tokenize_record(tokenizer: PreTrainedTokenizerBase, record: Mapping[str, Any]) -> tuple[list[int], list[int]]:
    """``(input_ids, labels)`` of one record, both ``[length]``; ``labels[i]`` is ``input_ids[i]`` on the
    assistant's (completion's) tokens and ``-100`` elsewhere."""
    if record.get("messages") is not None:
        return tokenize_conversation(tokenizer, list(record["messages"]), first_labelled=0)
    prompt, completion = record.get("prompt"), record.get("completion")
    if isinstance(prompt, str) and isinstance(completion, str):
        return tokenize_prompt_completion(tokenizer, prompt, completion)
    if isinstance(prompt, Sequence) and isinstance(completion, Sequence):
        return tokenize_conversation(tokenizer, [*prompt, *completion], first_labelled=len(prompt))
    raise TemplateError(
        f"A record needs 'messages' (a list of {{role, content}}) or 'prompt' and 'completion' (both strings or both "
        f"lists of messages); got the fields {sorted(k for k, v in record.items() if v is not None)}."
    )


def tokenize_conversation(
    tokenizer: PreTrainedTokenizerBase, messages: list[Message], first_labelled: int
) -> tuple[list[int], list[int]]:
    """The chat template's tokens of ``messages``, labelled on the assistant turns from ``messages[first_labelled]``
    on."""
    text, spans = assistant_character_spans(tokenizer, messages, first_labelled)
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]  # as apply_chat_template tokenizes
    labels = [IGNORE_INDEX] * len(ids)
    for start, end in spans:
        first, last = (_token_border(tokenizer, text, ids, border, add_special_tokens=False) for border in (start, end))
        labels[first:last] = ids[first:last]
    return ids, labels


def tokenize_prompt_completion(
    tokenizer: PreTrainedTokenizerBase, prompt: str, completion: str
) -> tuple[list[int], list[int]]:
    """``prompt + completion`` with the tokenizer's special tokens, then EOS; labelled from the completion's first
    token."""
    text = prompt + completion
    ids = tokenizer(text, add_special_tokens=True)["input_ids"]
    first = _token_border(tokenizer, text, ids, len(prompt), add_special_tokens=True)
    if tokenizer.eos_token_id is not None:
        ids = [*ids, tokenizer.eos_token_id]  # the model learns to stop
    return ids, [IGNORE_INDEX] * first + ids[first:]


def turn_end_token_id(tokenizer: PreTrainedTokenizerBase) -> int | None:
    """The special token with which the chat template ends an assistant turn (``<|im_end|>`` in ChatML, Llama 3's
    ``<|eot_id|>``): the first special token among the labelled tokens of a one-turn chat's answer, where ``generate``
    must stop. ``None`` for a tokenizer without a chat template, one whose turns end in no special token, or one
    whose assistant turns cannot be located."""
    if not getattr(tokenizer, "chat_template", None):
        return None
    chat: list[Message] = [{"role": "user", "content": "1+1?"}, {"role": "assistant", "content": "2"}]
    try:
        ids, labels = tokenize_conversation(tokenizer, chat, first_labelled=1)
    except TemplateError:
        return None
    special = set(tokenizer.all_special_ids)
    return next((i for i, label in zip(ids, labels) if label != IGNORE_INDEX and i in special), None)


def chat_template_of(tokenizer: PreTrainedTokenizerBase) -> str:
    template = tokenizer.chat_template
    if isinstance(template, dict):  # named templates: the default one renders conversations
        template = template.get("default")
    if not template:
        raise TemplateError(
            f"The tokenizer {tokenizer.name_or_path!r} has no chat template, which 'messages' records need. Use a "
            "tokenizer folder with one (tokenizer_config.json's chat_template or chat_template.jinja), or give "
            "'prompt'/'completion' strings."
        )
    return template


def assistant_character_spans(
    tokenizer: PreTrainedTokenizerBase, messages: list[Message], first_labelled: int = 0
) -> tuple[str, list[tuple[int, int]]]:
    """The rendered conversation and the ``[start, end)`` character spans of its labelled assistant turns."""
    template = chat_template_of(tokenizer)
    text = _render(tokenizer, messages, add_generation_prompt=False)
    prompt_end = len(_rendered_prefix(tokenizer, text, messages[:first_labelled], True)) if first_labelled else 0
    if GENERATION_TAG.search(template):
        from transformers.utils.chat_template_utils import render_jinja_template

        special_tokens: dict[str, Any] = tokenizer.special_tokens_map  # the template's variables
        # transformers annotates it "-> str"; it returns the texts and each one's assistant spans
        rendered, indices = cast(
            tuple[list[str], list[list[tuple[int, int]]]],
            render_jinja_template(
                conversations=[messages],  # type: ignore[list-item]  # annotated dicts; jinja reads any mapping
                chat_template=template,
                return_assistant_tokens_mask=True,
                **special_tokens,
            ),
        )
        if rendered[0] != text:
            raise TemplateError("The chat template renders differently with its {% generation %} markers tracked.")
        return text, [(start, end) for start, end in indices[0] if start >= prompt_end and end > start]
    spans = []
    for i, message in enumerate(messages):
        if i < first_labelled or message.get("role") != "assistant":
            continue
        start = len(_rendered_prefix(tokenizer, text, messages[:i], True))
        end = len(_rendered_prefix(tokenizer, text, messages[: i + 1], False))
        content = message.get("content")
        if end <= start or (isinstance(content, str) and content.strip() not in text[start:end]):
            raise TemplateError(
                f"The chat template does not put assistant message {i}'s content between its generation prompt and the "
                f"end of that turn ({text[start:end]!r}). Add {{% generation %}} markers around the assistant's part "
                "of the template."
            )
        spans.append((start, end))
    return text, spans


def _render(tokenizer: PreTrainedTokenizerBase, messages: list[Message], add_generation_prompt: bool) -> str:
    text = tokenizer.apply_chat_template(
        messages,  # type: ignore[arg-type]  # annotated dicts; the template reads any mapping
        tokenize=False,
        add_generation_prompt=add_generation_prompt,
    )
    return cast(str, text)  # tokenize=False: the rendered text


def _rendered_prefix(
    tokenizer: PreTrainedTokenizerBase, text: str, messages: list[Message], add_generation_prompt: bool
) -> str:
    """The rendering of the first messages, which must begin the rendering of the whole conversation."""
    prefix = _render(tokenizer, messages, add_generation_prompt) if messages else ""
    if not text.startswith(prefix):
        raise TemplateError(
            f"The chat template renders the first {len(messages)} messages as {prefix[-80:]!r}, which does not begin "
            f"the rendering of the whole conversation (... {text[max(len(prefix) - 80, 0) : len(prefix)]!r}): earlier "
            "turns change once later turns follow (e.g. reasoning dropped from earlier turns), so the assistant's "
            "tokens cannot be located by prefix. Add {% generation %} markers around the assistant's part of the "
            "template."
        )
    return prefix


def _token_border(
    tokenizer: PreTrainedTokenizerBase, text: str, ids: list[int], border: int, add_special_tokens: bool
) -> int:
    """The index of the token of ``ids`` (the tokens of ``text``) that starts at character ``border``."""
    if border == len(text):
        return len(ids)
    head = tokenizer(text[:border], add_special_tokens=add_special_tokens)["input_ids"]
    if ids[: len(head)] != head:
        raise TemplateError(
            "A token of the conversation spans the border of an assistant turn at "
            f"{text[max(border - 40, 0) : border]!r} | {text[border : border + 40]!r}: the text before it tokenizes "
            "differently alone. The labels would not "
            "fall on the assistant's tokens exactly. Put a separator the tokenizer does not merge (e.g. a special "
            "token or a newline) at the border in the chat template."
        )
    return len(head)
