"""Fixture records for the fine-tuning tests: chats of exact token lengths under the byte chat tokenizer."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

WORDS = [
    "sum",
    "the",
    "numbers",
    "then",
    "check",
    "each",
    "digit",
    "twice",
    "before",
    "you",
    "answer",
    "with",
    "the",
    "total",
]
USER_OVERHEAD, ASSISTANT_OVERHEAD = 8, 13  # "<|im_start|>user\n" ... "<|im_end|>\n" under the byte chat tokenizer


def text_of_length(length: int, seed: int) -> str:
    words = [WORDS[(seed * 5 + i * 3) % len(WORDS)] for i in range(length)]
    return " ".join(words)[:length]


def chat(user: int, assistant: int, seed: int, turns: int = 1, system: bool = False) -> dict[str, Any]:
    """A chat of ``turns`` user/assistant exchanges with contents of ``user`` and ``assistant`` bytes each."""
    messages = [{"role": "system", "content": "Answer in words."}] if system else []
    for turn in range(turns):
        messages.append({"role": "user", "content": text_of_length(user, seed + turn)})
        messages.append({"role": "assistant", "content": text_of_length(assistant, seed + turn + 7)})
    return {"messages": messages}


def chat_of_tokens(total: int, seed: int) -> dict[str, Any]:
    """A one-exchange chat of exactly ``total`` tokens, about half of them the assistant's."""
    content = total - USER_OVERHEAD - ASSISTANT_OVERHEAD
    return chat(content // 2, content - content // 2, seed)


def sft_records(seq_len: int) -> list[dict[str, Any]]:
    """Chats that pack, at ``seq_len`` (even), into rows with a sample border exactly at ``seq_len / 2`` and samples
    that span it; one longer than ``seq_len``; multi-turn chats with a system message."""
    half = seq_len // 2
    return [
        chat_of_tokens(half, 1),
        chat_of_tokens(half, 2),  # one row, border at the shard border
        chat_of_tokens(half + 8, 3),
        chat_of_tokens(half - 8, 4),  # a sample across the shard border
        chat_of_tokens(seq_len, 5),  # exactly one row
        chat_of_tokens(seq_len + 17, 6),  # longer than a row
        chat(2, 3, 7, system=True),
        chat(5, 2, 8, turns=2),
        chat(6, 9, 9),
        chat(4, 3, 10, turns=1, system=True),
    ]


def write_jsonl(path: Path, records: list[dict[str, Any]]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(record) + "\n" for record in records))
    return path


def preference_records() -> list[dict[str, Any]]:
    """Conversational pairs of several lengths: prompts with and without a system message, answers that differ."""
    records = []
    for i in range(6):
        prompt = chat(5 + 7 * i, 1, i, system=i % 2 == 0)["messages"][:-1]
        chosen = text_of_length(4 + 3 * i + (40 if i == 5 else 0), i + 1)  # the last chosen is the longest sequence
        rejected = text_of_length(9 + (5 * i) % 13, i + 2)
        records.append(
            {
                "prompt": prompt,
                "chosen": [{"role": "assistant", "content": chosen}],
                "rejected": [{"role": "assistant", "content": rejected}],
            }
        )
    return records
