"""Survey of head chunks with the projections inside them (:mod:`lightning_ulysses.hf.projections`): which zoo
families' attention modules the package can run once per head chunk, and do the chunks sum to the module's output?

One process, eval mode, no gradients, fp32. Each causal-LM ``model_type`` is built from its tiny config (the flagship
config's proportions, :func:`tests.zoo_configs.tiny_recipe`) and runs 32 tokens with its own eager attention. Its first
attention module (the first with an ``nn.Linear`` query projection) is given to
:func:`~lightning_ulysses.hf.projections.find_projections` and, where that finds projections that narrow per head,
called again on the inputs it got through :func:`~lightning_ulysses.hf.projections.chunked_call`: the chunks of
``head_chunks=2`` over two ranks' head layout, each with the module's projections, gates, head counts and output width
narrowed to the chunk's heads, summed. Unlike the set-up check (which compares with token-local attention), the
module attends with its own kernel here. Verdicts:

* ``equal``: the chunks' summed output is the module's (relative error < 1e-5);
* ``differs``: it runs and is not (heads that mix: differential attention);
* ``fails``: the chunked call raises (a norm over all heads' projections, ...);
* ``not narrowable``: ``find_projections`` gives a reason (a gate inside the query projection, parameters of the
  module's own such as attention sinks); the set-up check keeps attention-only chunks for these, as for the two above;
* ``other layout``: no module with those four (fused ``qkv``, MLA's latent, an output projection in another module,
  no attention);
* ``not run``: the plain model does not build or run, or never calls the module.

``python -m benchmarks.projection_chunks --output benchmarks/projection_chunks.md`` (every family, ~20 s on 1 core);
family names as arguments survey only those.
"""

from __future__ import annotations

import argparse
import os
import warnings
from collections import Counter
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

from benchmarks.measure import publish
from lightning_ulysses.heads import plan_heads
from lightning_ulysses.hf.projections import PROJECTION_NAMES, chunked_call, find_projections

TOKENS = 32
TOLERANCE = 1e-5
SP = 2  # the head layout the chunks are cut from
CHUNKS = 2


def _projections(module: nn.Module) -> bool:
    """Whether ``module`` has an ``nn.Linear`` child by each name of a query, key, value and output projection."""
    return all(
        any(isinstance(getattr(module, name, None), nn.Linear) for name in names) for names in PROJECTION_NAMES.values()
    )


def survey(model_type: str) -> dict[str, Any]:
    """One family's row: ``family``, ``verdict``, ``detail`` (the module and its head counts, or what failed)."""
    from tests.zoo_configs import tiny_recipe

    row: dict[str, Any] = {"family": model_type, "verdict": "not run", "detail": ""}
    try:
        recipe = tiny_recipe(model_type)
        model = recipe.build("eager").eval()
    except Exception as exc:  # noqa: BLE001 - a family whose tiny model does not build is reported, not fatal
        return {**row, "detail": f"not built: {type(exc).__name__}"}
    found = next(((name, m) for name, m in model.named_modules() if _projections(m)), None)
    if found is None:
        return {**row, "verdict": "other layout"}
    name, module = found
    calls: list[tuple[tuple, dict[str, Any], Tensor]] = []

    def record(m: nn.Module, args: tuple, kwargs: dict[str, Any], out: Any) -> None:
        calls.append((args, kwargs, out[0] if isinstance(out, tuple) else out))

    hook = module.register_forward_hook(record, with_kwargs=True)
    ids = torch.tensor([recipe.token_ids[i % len(recipe.token_ids)] for i in range(TOKENS)])[None]
    try:
        with torch.no_grad():
            model(input_ids=ids)
    except Exception as exc:  # noqa: BLE001
        return {**row, "detail": f"the plain model fails: {type(exc).__name__}"}
    finally:
        hook.remove()
    if not calls:
        return {**row, "detail": f"{name} is not called"}
    args, kwargs, expected = calls[0]
    heads, kv_heads, qk_dim, value_dim = _head_shapes(module, model.config.get_text_config())
    spec = find_projections(module, heads, kv_heads, qk_dim, value_dim, CHUNKS)
    detail = f"`{name}`, heads {heads}, K/V heads {kv_heads}"
    if isinstance(spec, str):
        return {**row, "verdict": "not narrowable", "detail": f"{detail}: {spec}"}
    try:
        with torch.no_grad():
            out = chunked_call(module, spec, plan_heads(heads, kv_heads, SP), module.forward, args, kwargs)
        got = out[0] if isinstance(out, tuple) else out
        error = ((got - expected).norm() / expected.norm()).item()
    except Exception as exc:  # noqa: BLE001
        return {**row, "verdict": "fails", "detail": f"{detail}: {type(exc).__name__}: {str(exc).splitlines()[0][:90]}"}
    verdict = "equal" if error < TOLERANCE else "differs"
    return {**row, "verdict": verdict, "detail": f"{detail}, relative error {error:.1e}"}


def _head_shapes(module: nn.Module, config: Any) -> tuple[int, int, int, int]:
    """``(heads, K/V heads, query/key head size, value head size)`` from the module's attributes and projections (the
    set-up check reads them from its attention call instead)."""
    linear = {
        role: next(getattr(module, n) for n in names if isinstance(getattr(module, n, None), nn.Linear))
        for role, names in PROJECTION_NAMES.items()
        if role != "output"
    }
    heads = getattr(module, "num_heads", None) or getattr(config, "num_attention_heads", None) or 1
    qk_dim = getattr(module, "head_dim", None) or linear["query"].out_features // heads
    kv_heads = max(1, linear["key"].out_features // qk_dim)
    return heads, kv_heads, qk_dim, linear["value"].out_features // kv_heads


def report(rows: list[dict[str, Any]]) -> str:
    counts = Counter(row["verdict"] for row in rows)
    lines = [
        f"Attention modules run per head chunk with narrowed projections, {len(rows)} families: "
        + ", ".join(f"{verdict} {count}" for verdict, count in counts.most_common())
        + " (`python -m benchmarks.projection_chunks`).",
        "",
        "| family | verdict | detail |",
        "|---|---|---|",
    ]
    lines += [f"| {row['family']} | {row['verdict']} | {row['detail']} |" for row in rows]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("families", nargs="*", help="model types to survey (default: every causal-LM model type)")
    parser.add_argument("--output", type=Path)
    args = parser.parse_args(argv)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        rows = [survey(family) for family in args.families or sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)]
    text = report(rows)
    publish(text, args.output)
    return rows


if __name__ == "__main__":
    main()
