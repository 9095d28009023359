"""The kernels of attention-bound steps, timed side by side on one GPU, each with its error against float64.

    python -m benchmarks.kernels --output kernels.md                       # GPU: ~90 s on an H100
    python -m benchmarks.kernels --output kernels.md --device cpu --quick  # CPU smoke run, tiny sizes

Four tables, each row appended to ``--output`` (and printed) as soon as it is measured:

1. **Core attention**, forward + backward, bf16, one causal document of ``--seq`` tokens at Llama-3.1-8B's head
   shape (32 query heads, 8 K/V heads, head size 128): ``sdpa`` (torch's flash kernel), ``sdpa_cudnn`` (SDPA's cuDNN
   backend), compiled ``flex_attention``, flash-attn 2 / 3 where importable; median time, TFLOP/s (causal), the torch
   ops that ran (from the profiler: the kernel that was actually chosen), and the relative error of the output and the
   q/k/v gradients against the float64 dense reference at ``--check-seq`` tokens.
2. **Loss**: ``lm_head`` + cross entropy of ``--loss-tokens`` tokens at Llama 3's vocabulary (128,256) and hidden
   size 4096: this package's tiled loss against Liger's fused linear cross entropy; time, peak memory, error.
3. **Norm and SwiGLU**: transformers' Llama RMSNorm (eager), :func:`~lightning_ulysses.norms.rms_norm` (the fused norm)
   and Liger's RMSNorm; ``silu(gate) * up`` eager and Liger's SwiGLU; forward + backward, error against float64.
4. **Decoder layer**: one Llama-3.1-8B-shaped decoder layer at ``--layer-seq`` tokens, eager against
   ``compile_decoder_layers`` (regional ``torch.compile``); the compiled row's time excludes its compilation, which is
   reported beside it.

A kernel that cannot run here is a row saying why (not installed, CUDA only, no CPU backward).
"""

from __future__ import annotations

import argparse
import datetime
import importlib.util
import math
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from lightning_ulysses.attention import CORE_ATTENTION
from lightning_ulysses.compile import compile_decoder_layers
from lightning_ulysses.logits import tiled_cross_entropy_sum
from lightning_ulysses.norms import rms_norm

HEADS, KV_HEADS, HEAD_DIM, HIDDEN, INTERMEDIATE, VOCAB = 32, 8, 128, 4096, 14336, 128256  # Llama-3.1-8B
QUICK = dict(heads=4, kv_heads=2, head_dim=16, hidden=64, intermediate=96, vocab=500)
ATTENTION_BACKENDS = ("sdpa", "sdpa_cudnn", "flex_attention", "flash_attention_2", "flash_attention_3")
_MODULE = {"flash_attention_2": "flash_attn", "flash_attention_3": "flash_attn_interface"}


class Report:
    """A markdown file written a row at a time (flushed), echoed to stdout."""

    def __init__(self, path: Path) -> None:
        self.path = path
        path.write_text("")

    def line(self, text: str = "") -> None:
        print(text, flush=True)
        with self.path.open("a") as file:
            file.write(text + "\n")

    def table(self, columns: Sequence[str]) -> None:
        self.line()
        self.line("| " + " | ".join(columns) + " |")
        self.line("|" + " --- |" * len(columns))

    def row(self, cells: Sequence[object]) -> None:
        self.line("| " + " | ".join(str(c) for c in cells) + " |")


def timed(run: Callable[[], object], device: torch.device, repeats: int) -> float:
    """Median seconds of ``run`` over ``repeats`` calls after one warm-up call."""
    times = []
    for _ in range(repeats + 1):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        run()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times[1:])


def relative_errors(got: Sequence[Tensor], expected: Sequence[Tensor]) -> str:
    """The largest ``|got - expected| / |expected|`` over the tensors, as text."""
    worst = max(((g.double() - e.double()).norm() / e.double().norm()).item() for g, e in zip(got, expected))
    return f"{worst:.1e}"


def forward_backward(fn: Callable[..., Tensor], inputs: Sequence[Tensor], grad: Tensor) -> list[Tensor]:
    """``fn(*inputs)`` and the gradients of ``(out * grad).sum()`` with respect to ``inputs``."""
    out = fn(*inputs)
    return [out, *torch.autograd.grad(out, list(inputs), grad)]


def unavailable(name: str, device: torch.device) -> str | None:
    """Why attention backend ``name`` cannot run here, or None."""
    if name in _MODULE and importlib.util.find_spec(_MODULE[name]) is None:
        return f"{_MODULE[name]} not installed"
    if name != "sdpa" and device.type != "cuda":
        return "CUDA only" if name != "flex_attention" else "torch has no CPU flex backward"
    if name == "sdpa_cudnn" and not torch.backends.cudnn.is_available():
        return "torch has no cuDNN"
    return None


def dense_reference(q: Tensor, k: Tensor, v: Tensor) -> Tensor:
    """Causal attention of ``[B, N, H, D]`` tensors with explicit scores (GQA by repeating the K/V heads)."""
    n, groups = q.shape[1], q.shape[2] // k.shape[2]
    k, v = (t.repeat_interleave(groups, dim=2) for t in (k, v))
    scores = torch.einsum("bqhd,bkhd->bhqk", q, k) / q.shape[-1] ** 0.5
    mask = torch.ones(n, n, dtype=torch.bool, device=q.device).tril()
    return torch.einsum("bhqk,bkhd->bqhd", scores.masked_fill(~mask, float("-inf")).softmax(-1), v)


def attention_inputs(seq: int, shape: dict[str, int], device: torch.device, dtype: torch.dtype) -> list[Tensor]:
    generator = torch.Generator(device).manual_seed(0)
    sizes = [(shape["heads"], shape["head_dim"])] + [(shape["kv_heads"], shape["head_dim"])] * 2
    sizes.append((shape["heads"], shape["head_dim"]))  # the output gradient
    return [torch.randn(1, seq, h, d, generator=generator, device=device, dtype=dtype) for h, d in sizes]


def ops_that_ran(run: Callable[[], object]) -> str:
    """The attention ops torch ran in ``run`` (the kernel SDPA chose), from the profiler."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profile:
        run()
    names = {e.name.split("::")[-1].lstrip("_") for e in profile.events()}
    kernels = ("scaled_dot_product_", "flash_attn", "flex_attention")
    chosen = sorted(
        n for n in names if any(k in n for k in kernels) and "backward" not in n and n != "scaled_dot_product_attention"
    )
    return ", ".join(chosen) or "-"


def attention_table(report: Report, args: argparse.Namespace, device: torch.device, shape: dict[str, int]) -> None:
    dtype = torch.bfloat16
    report.line(f"\n## Core attention: forward + backward, {dtype}, one causal document, {shape}")
    report.table(["backend", f"ms at {args.seq}", "TFLOP/s", "ops that ran", f"error vs float64 at {args.check_seq}"])
    q, k, v, grad = attention_inputs(args.seq, shape, device, dtype)
    cq, ck, cv, cgrad = attention_inputs(args.check_seq, shape, device, torch.float64)
    expected = forward_backward(dense_reference, [t.requires_grad_() for t in (cq, ck, cv)], cgrad)
    # causal: half the scores; forward 2 matmuls, backward 5 (recomputing the scores): 3.5x the forward's 2 * N^2 * D
    flops = 3.5 * 2 * args.seq**2 * shape["head_dim"] * shape["heads"]
    for name in ATTENTION_BACKENDS:
        why = unavailable(name, device)
        if why is not None:
            report.row([name, "-", "-", why, "-"])
            continue
        core = CORE_ATTENTION[name]

        def attend(*qkv: Tensor, core: Callable[..., Tensor] = core) -> Tensor:
            return core(*qkv, None, scale=None, dropout_p=0.0, window=None)

        inputs = [t.detach().requires_grad_() for t in (q, k, v)]
        seconds = timed(
            lambda attend=attend, inputs=inputs: forward_backward(attend, inputs, grad), device, args.repeats
        )
        checked = [t.detach().to(dtype).requires_grad_() for t in (cq, ck, cv)]
        got = forward_backward(attend, checked, cgrad.to(dtype))
        ran = ops_that_ran(lambda attend=attend, checked=checked: forward_backward(attend, checked, cgrad.to(dtype)))
        report.row([name, f"{seconds * 1e3:.2f}", f"{flops / seconds / 1e12:.3g}", ran, relative_errors(got, expected)])


def liger_functional() -> Any:
    """``liger_kernel.transformers.functional`` where it imports (needs Triton and CUDA), else None."""
    if importlib.util.find_spec("liger_kernel") is None or not torch.cuda.is_available():
        return None
    import liger_kernel.transformers.functional as functional

    return functional


def peak_bytes(run: Callable[[], object], device: torch.device) -> str:
    if device.type != "cuda":
        run()
        return "-"
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    base = torch.cuda.memory_allocated(device)
    run()
    torch.cuda.synchronize(device)
    return f"{(torch.cuda.max_memory_allocated(device) - base) / 2**30:.2f} GiB"


def loss_table(report: Report, args: argparse.Namespace, device: torch.device, shape: dict[str, int]) -> None:
    dtype, hidden, vocab = torch.bfloat16, shape["hidden"], shape["vocab"]
    report.line(f"\n## Loss: lm_head + cross entropy, {dtype}, hidden {hidden}, vocabulary {vocab}")
    report.table(["kernel", f"ms at {args.loss_tokens} tokens", "peak memory", "error vs float64 at 1024 tokens"])
    generator = torch.Generator(device).manual_seed(0)

    def inputs(tokens: int, dtype: torch.dtype) -> list[Tensor]:
        h = torch.randn(tokens, hidden, generator=generator, device=device, dtype=dtype)
        w = torch.randn(vocab, hidden, generator=generator, device=device, dtype=dtype) * hidden**-0.5
        return [h, w, torch.randint(0, vocab, (tokens,), generator=generator, device=device)]

    big, small = inputs(args.loss_tokens, dtype), inputs(1024, torch.float64)
    tiles = math.ceil(args.loss_tokens / hidden)
    functional = liger_functional()
    kernels: dict[str, Callable[[Tensor, Tensor, Tensor], Tensor] | str] = {
        f"tiled_loss ({tiles} tiles)": lambda h, w, y: tiled_cross_entropy_sum(h, lambda x: x @ w.t(), y, tiles),
        "Liger fused linear cross entropy": (
            "liger_kernel not importable (needs Triton, CUDA)"
            if functional is None
            else lambda h, w, y: functional.liger_fused_linear_cross_entropy(h, w, y, reduction="sum")
        ),
    }
    expected = _loss_and_grads(lambda h, w, y: F.cross_entropy(h @ w.t(), y, reduction="sum"), small)
    for name, kernel in kernels.items():
        if isinstance(kernel, str):
            report.row([name, "-", "-", kernel])
            continue
        seconds = timed(lambda kernel=kernel: _loss_and_grads(kernel, big), device, args.repeats)
        memory = peak_bytes(lambda kernel=kernel: _loss_and_grads(kernel, big), device)
        got = _loss_and_grads(kernel, [t.to(dtype) if t.is_floating_point() else t for t in small])
        report.row([name, f"{seconds * 1e3:.2f}", memory, relative_errors(got, expected)])


def _loss_and_grads(kernel: Callable[[Tensor, Tensor, Tensor], Tensor], inputs: list[Tensor]) -> list[Tensor]:
    h, w, y = inputs
    h, w = h.detach().requires_grad_(), w.detach().requires_grad_()
    loss = kernel(h, w, y)
    return [loss, *torch.autograd.grad(loss, [h, w])]


def norm_table(report: Report, args: argparse.Namespace, device: torch.device, shape: dict[str, int]) -> None:
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    dtype, hidden, tokens = torch.bfloat16, shape["hidden"], args.loss_tokens
    report.line(f"\n## RMSNorm and SwiGLU: forward + backward, {dtype}, {tokens} tokens")
    report.table(["kernel", "ms", "error vs float64"])
    generator = torch.Generator(device).manual_seed(0)
    x = torch.randn(tokens, hidden, generator=generator, device=device)
    weight = 1 + 0.1 * torch.randn(hidden, generator=generator, device=device)
    gate, up = (torch.randn(tokens, shape["intermediate"], generator=generator, device=device) for _ in range(2))
    llama_norm = LlamaRMSNorm(hidden, eps=1e-5).to(device)
    functional = liger_functional()
    liger = "liger_kernel not importable (needs Triton, CUDA)"

    def eager_norm(x: Tensor, w: Tensor) -> Tensor:
        return _call_with_weight(llama_norm, x, w)

    def eager_swiglu(a: Tensor, b: Tensor) -> Tensor:
        return F.silu(a) * b

    # name, kernel (or why it cannot run), the float64 reference it is checked against, inputs
    runs: list[tuple[str, Callable[..., Tensor] | str, Callable[..., Tensor], list[Tensor]]] = [
        ("RMSNorm: transformers (eager)", eager_norm, eager_norm, [x, weight]),
        ("RMSNorm: lightning_ulysses.norms.rms_norm", lambda x, w: rms_norm(x, w, 1e-5), eager_norm, [x, weight]),
        (
            "RMSNorm: Liger",
            liger if functional is None else lambda x, w: functional.liger_rms_norm(x, w, 1e-5, in_place=False),
            eager_norm,
            [x, weight],
        ),
        ("SwiGLU: silu(gate) * up (eager)", eager_swiglu, eager_swiglu, [gate, up]),
        ("SwiGLU: Liger", liger if functional is None else functional.liger_swiglu, eager_swiglu, [gate, up]),
    ]
    for name, fn, reference, inputs in runs:
        if isinstance(fn, str):
            report.row([name, "-", fn])
            continue
        grad = torch.randn_like(reference(*inputs))
        low = [t.to(dtype) for t in inputs]
        seconds = timed(
            lambda fn=fn, low=low, grad=grad: forward_backward(fn, [t.requires_grad_() for t in low], grad.to(dtype)),
            device,
            args.repeats,
        )
        expected = forward_backward(reference, [t.double().requires_grad_() for t in inputs], grad.double())
        got = forward_backward(fn, [t.detach().to(dtype).requires_grad_() for t in inputs], grad.to(dtype))
        report.row([name, f"{seconds * 1e3:.3f}", relative_errors(got, expected)])


def _call_with_weight(norm: torch.nn.Module, x: Tensor, weight: Tensor) -> Tensor:
    """``norm(x)`` with ``weight`` as its weight (a leaf of the caller's graph, so that it gets a gradient)."""
    return torch.func.functional_call(norm, {"weight": weight}, (x,))


def layer_table(report: Report, args: argparse.Namespace, device: torch.device, shape: dict[str, int]) -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    dtype = torch.bfloat16
    report.line(f"\n## Decoder layer: forward + backward, {dtype}, {args.layer_seq} tokens, {shape}")
    report.table(["layer", "ms", "compile s", "largest difference to eager"])
    config = LlamaConfig(
        hidden_size=shape["hidden"],
        intermediate_size=shape["intermediate"],
        num_attention_heads=shape["heads"],
        num_key_value_heads=shape["kv_heads"],
        head_dim=shape["head_dim"],
        num_hidden_layers=1,
        vocab_size=256,
        attn_implementation="sdpa",
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).to(device, dtype).train()
    ids = torch.randint(0, 256, (1, args.layer_seq), device=device)

    def step() -> Tensor:
        hidden = model.model(input_ids=ids).last_hidden_state
        hidden.float().square().mean().backward()
        return hidden.detach()

    eager = step()
    report.row(["eager", f"{timed(step, device, args.repeats) * 1e3:.2f}", "-", "-"])
    compile_decoder_layers(model, backend=args.compile_backend)
    start = time.perf_counter()
    compiled = step()
    compile_seconds = time.perf_counter() - start
    difference = (compiled.float() - eager.float()).abs().max().item()
    seconds = timed(step, device, args.repeats)
    report.row(
        [f"compiled ({args.compile_backend})", f"{seconds * 1e3:.2f}", f"{compile_seconds:.1f}", f"{difference:.2e}"]
    )


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--output", type=Path, required=True)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--quick", action="store_true", help="tiny sizes (a CPU smoke run)")
    parser.add_argument("--seq", type=int, default=32768, help="attention's sequence length")
    parser.add_argument("--check-seq", type=int, default=2048, help="length of the float64 attention check")
    parser.add_argument("--loss-tokens", type=int, default=16384)
    parser.add_argument("--layer-seq", type=int, default=8192)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--compile-backend", default="inductor")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    shape = dict(
        heads=HEADS, kv_heads=KV_HEADS, head_dim=HEAD_DIM, hidden=HIDDEN, intermediate=INTERMEDIATE, vocab=VOCAB
    )
    if args.quick:
        shape = dict(QUICK)
        args.seq, args.check_seq, args.loss_tokens, args.layer_seq = 256, 64, 256, 64
    report = Report(args.output)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    cudnn = torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None
    liger = importlib.util.find_spec("liger_kernel") is not None
    report.line(
        f"# Kernels for attention-bound steps ({datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC)"
    )
    report.line(
        f"\n{name}; torch {torch.__version__}, cuDNN {cudnn}, liger_kernel {'installed' if liger else 'absent'}"
    )
    report.line(f"command: python -m benchmarks.kernels {' '.join(sys.argv[1:] if argv is None else argv)}")
    for table in (attention_table, loss_table, norm_table, layer_table):
        start = time.perf_counter()
        table(report, args, device, shape)
        report.line(f"\n({table.__name__}: {time.perf_counter() - start:.0f} s, compilations included)")


if __name__ == "__main__":
    main()
