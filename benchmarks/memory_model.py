"""Analytic activation memory and extra compute per token of a Llama-style decoder under the memory options.

    python -m benchmarks.memory_model                  # the Llama-3.1-8B table of docs/memory.md (bf16)
    python -m benchmarks.memory_model --benchmark      # predictions for benchmarks.memory's model (fp32)

Memory: the bytes per token of a rank at the step's peak, by component and under each option, are
:mod:`lightning_ulysses.memory.estimate`'s model (its docstring lists what is counted and what is left out: weights,
their gradients and optimizer states, per-tile buffers), which the strategy's out-of-memory line also uses.

Compute: training costs ``6 * P`` FLOPs per token for the ``P`` weights of the matrix products plus
``6 * layers * hidden * N`` for causal attention over ``N`` keys (see :mod:`lightning_ulysses.flops`).
Checkpointing adds one forward of the layers, ``2 * P_layers + 2 * layers * hidden * N``; ``tiled_loss`` one
``lm_head`` forward, ``2 * hidden * vocab``; ``tiled_mlp`` one MLP forward per tile recomputation (one more
inside checkpointed layers, whose recomputation is itself not saved).
"""

from __future__ import annotations

import argparse

from lightning_ulysses.memory.estimate import DecoderShape, components, peak_bytes_per_token

KiB = 1024

# https://huggingface.co/meta-llama/Llama-3.1-8B/blob/main/config.json
LLAMA_31_8B = DecoderShape(hidden=4096, intermediate=14336, layers=32, heads=32, kv_heads=8, head_dim=128, vocab=128256)
# benchmarks.memory.MODEL
BENCHMARK = DecoderShape(hidden=128, intermediate=512, layers=2, heads=8, kv_heads=4, head_dim=16, vocab=16000)


def flops_per_token(
    shape: DecoderShape, seq_len: int, *, tiled_mlp: bool = False, tiled_loss: bool = False, checkpointing: bool = False
) -> float:
    """Training FLOPs per token (matrix products and causal attention over ``seq_len`` keys)."""
    lm_head = shape.hidden * shape.vocab
    layers = shape.layers * shape.layer_params
    attention_forward = 2 * shape.layers * shape.heads * shape.head_dim * seq_len  # causal: half of N^2 pairs
    flops = 6 * (layers + lm_head) + 3 * attention_forward
    mlp_forward = 2 * shape.layers * 3 * shape.hidden * shape.intermediate
    if checkpointing:
        flops += 2 * layers + attention_forward
    if tiled_loss:
        flops += 2 * lm_head
    if tiled_mlp:
        flops += mlp_forward * (2 if checkpointing else 1)
    return flops


OPTIONS: dict[str, dict[str, bool]] = {
    "plain": {},
    "tiled_mlp": dict(tiled_mlp=True),
    "tiled_loss": dict(tiled_loss=True),
    "checkpointing": dict(checkpointing=True),
    "tiled_loss+checkpointing": dict(tiled_loss=True, checkpointing=True),
    "all (on the GPU)": dict(tiled_mlp=True, tiled_loss=True, checkpointing=True, offload=True),
    "all but offload": dict(tiled_mlp=True, tiled_loss=True, checkpointing=True),
}


def component_table(shape: DecoderShape, element_bytes: int) -> str:
    lines = ["| component | KiB per token |", "|---|---|"]
    lines += [f"| {name} | {value / KiB:,.1f} |" for name, value in components(shape, element_bytes).items()]
    return "\n".join(lines)


def options_table(shape: DecoderShape, element_bytes: int, budget_gib: float, seq_len: int) -> str:
    plain_flops = flops_per_token(shape, seq_len)
    lines = [
        f"| options | KiB per token | tokens per rank in {budget_gib:.0f} GiB | FLOPs per token at N={seq_len:,} "
        "(x plain) |",
        "|---|---|---|---|",
    ]
    for name, options in OPTIONS.items():
        per_token = peak_bytes_per_token(shape, element_bytes, **options)
        flops = flops_per_token(shape, seq_len, **{k: v for k, v in options.items() if k != "offload"})
        lines.append(
            f"| {name} | {per_token / KiB:,.1f} | {budget_gib * 2**30 / per_token:,.0f} "
            f"| {flops / 1e9:,.0f} G ({flops / plain_flops:.2f}) |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--benchmark", action="store_true", help="benchmarks.memory's model in fp32 instead")
    parser.add_argument("--budget-gib", type=float, default=100.0, help="activation memory of a rank")
    parser.add_argument("--seq-len", type=int, default=131072, help="keys per query for the attention FLOPs")
    args = parser.parse_args(argv)
    shape, element_bytes = (BENCHMARK, 4) if args.benchmark else (LLAMA_31_8B, 2)
    print(component_table(shape, element_bytes), end="\n\n")
    print(options_table(shape, element_bytes, args.budget_gib, args.seq_len))


if __name__ == "__main__":
    main()
