"""Writes the small fine-tuning data sets of ``configs/sft_quickstart.yaml`` and ``configs/dpo_quickstart.yaml``.

``python scripts/make_finetune_data.py`` rewrites ``examples/data/{sft,dpo}_arithmetic.jsonl`` (deterministic):
multi-turn arithmetic chats (``messages``) and preference pairs (``prompt``/``chosen``/``rejected``) whose rejected
answer is off by a small amount. A model of the quickstart's size learns the format and part of the sums on CPU.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

OUT = Path(__file__).resolve().parent.parent / "examples" / "data"
SYSTEM = {"role": "system", "content": "You are a careful calculator. Answer with the equation."}


def exchange(rng: random.Random, value: int | None) -> tuple[str, int, str]:
    """A question (on ``value``, the previous answer, if given), its result and the answer text."""
    op = rng.choice("+-*")
    b = rng.randint(2, 9) if op == "*" else rng.randint(1, 99)
    a = value if value is not None else rng.randint(1, 99)
    result = {"+": a + b, "-": a - b, "*": a * b}[op]
    words = {"+": "plus", "-": "minus", "*": "times"}[op]
    question = f"And {words} {b}?" if value is not None else f"What is {a} {words} {b}?"
    return question, result, f"{a} {op} {b} = {{}}."


def sft_record(rng: random.Random) -> dict:
    messages = [SYSTEM] if rng.random() < 0.5 else []
    value = None
    for _ in range(rng.randint(1, 4)):
        question, value, answer = exchange(rng, value)
        messages += [{"role": "user", "content": question}, {"role": "assistant", "content": answer.format(value)}]
    return {"messages": messages}


def dpo_record(rng: random.Random) -> dict:
    question, value, answer = exchange(rng, None)
    wrong = value + rng.choice([-10, -2, -1, 1, 2, 10])
    prompt = [SYSTEM, {"role": "user", "content": question}]
    return {
        "prompt": prompt,
        "chosen": [{"role": "assistant", "content": answer.format(value)}],
        "rejected": [{"role": "assistant", "content": answer.format(wrong)}],
    }


def main() -> None:
    rng = random.Random(0)
    OUT.mkdir(parents=True, exist_ok=True)
    for name, make, count in (("sft_arithmetic", sft_record, 400), ("dpo_arithmetic", dpo_record, 300)):
        (OUT / f"{name}.jsonl").write_text("".join(json.dumps(make(rng)) + "\n" for _ in range(count)))


if __name__ == "__main__":
    main()
