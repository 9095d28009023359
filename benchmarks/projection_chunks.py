"""Survey for head chunks with the projections inside them (docs/memory.md, "designed, not built"): does each zoo
family's attention module, called once per chunk of its heads with the query, key and value projections narrowed to
the chunk's heads and the output projection to their columns (its bias added once), sum to its own output?

One process, eval mode, no gradients, fp32. Each causal-LM ``model_type`` is built from its tiny config (the flagship
config's proportions, :func:`tests.zoo_configs.tiny_recipe`) and runs 32 tokens. The first module that has four
``nn.Linear`` children named as a query, key, value and output projection is called again, on the inputs it got, in
two chunks: whole K/V groups per chunk where it has two or more K/V heads, else half of the query heads each with the
one K/V head. The head counts the module reads (``num_heads``, ``num_key_value_heads``, ``num_key_value_groups``) are
set per chunk, and so are the widths it reshapes to (``embed_dim``, ``hidden_size``, ``all_head_size``) where they
are the heads' output width. Its other per-head weights are narrowed alike: ``nn.Linear`` children with ``H * d``
outputs (output gates) to the chunk's heads' rows, parameters of ``H`` rows (sinks) to the chunk's heads. Verdicts:

* ``equal``: the chunks' summed output is the module's (relative error < 1e-5);
* ``differs``: it runs and is not (heads that mix: differential attention);
* ``fails``: the chunked call raises (a norm over all heads' projections, ...), or the query projection is wider
  than the heads (a gate in it);
* ``other layout``: no such four projections (fused ``qkv``, MLA's latent, an output projection in another module,
  no attention);
* ``not run``: the plain model does not build or run, or never calls the module.

``python -m benchmarks.projection_chunks --output benchmarks/projection_chunks.md`` (every family, ~20 s on 1 core);
family names as arguments survey only those.
"""

from __future__ import annotations

import argparse
import copy
import os
import warnings
from collections import Counter
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

from benchmarks.measure import publish

TOKENS = 32
TOLERANCE = 1e-5
ROLES = {
    "query": ("q_proj", "query"),
    "key": ("k_proj", "key"),
    "value": ("v_proj", "value"),
    "output": ("o_proj", "out_proj", "dense", "o"),
}
HEAD_COUNTS = ("num_heads", "num_attention_heads", "num_key_value_heads", "num_key_value_groups")
WIDTHS = ("embed_dim", "hidden_size", "all_head_size")  # set per chunk where they equal the heads' output width


def projections(module: nn.Module) -> dict[str, str] | None:
    """The child names of ``module``'s query, key, value and output projections, or ``None`` where one is missing."""
    children = dict(module.named_children())
    found = {
        role: next((name for name in names if isinstance(children.get(name), nn.Linear)), None)
        for role, names in ROLES.items()
    }
    return None if None in found.values() else found  # type: ignore[return-value]


def narrowed(linear: nn.Linear, rows: list[int] | None = None, columns: list[int] | None = None) -> nn.Linear:
    """A copy of ``linear`` with only the output ``rows`` and input ``columns`` of its weight (and the rows' bias)."""
    weight = linear.weight.detach()
    weight = weight if rows is None else weight[rows]
    weight = weight if columns is None else weight[:, columns]
    new = nn.Linear(weight.shape[1], weight.shape[0], bias=linear.bias is not None)
    new.weight.data = weight.clone()
    if linear.bias is not None:
        new.bias.data = (linear.bias.detach() if rows is None else linear.bias.detach()[rows]).clone()
    return new


def head_chunks(heads: int, kv_heads: int) -> list[tuple[list[int], list[int]]]:
    """Two chunks ``(query heads, K/V heads)``: whole K/V groups, or halves of the query heads of one K/V head."""
    group = heads // kv_heads
    if kv_heads >= 2:
        halves = [list(range(kv_heads // 2)), list(range(kv_heads // 2, kv_heads))]
        return [([kv * group + i for kv in half for i in range(group)], half) for half in halves]
    return [(list(range(heads // 2)), [0]), (list(range(heads // 2, heads)), [0])]


def rows(heads: list[int], dim: int) -> list[int]:
    """The rows (or columns) of ``heads`` in a weight laid out head by head, ``dim`` each."""
    return [head * dim + i for head in heads for i in range(dim)]


def chunk_of(
    module: nn.Module, names: dict[str, str], heads: int, chunk: tuple[list[int], list[int]], first: bool
) -> nn.Module:
    """A copy of ``module`` that computes only ``chunk``'s ``(query heads, K/V heads)``: its projections, per-head
    weights, head counts and output width narrowed (the output projection's bias kept in the ``first`` chunk only)."""
    query_heads, kv = chunk
    qk_dim = getattr(module, names["query"]).out_features // heads
    value_dim = getattr(module, names["value"]).out_features // (getattr(module, names["key"]).out_features // qk_dim)
    narrow = copy.deepcopy(module)
    for role, chosen, dim in (("query", query_heads, qk_dim), ("key", kv, qk_dim), ("value", kv, value_dim)):
        setattr(narrow, names[role], narrowed(getattr(module, names[role]), rows=rows(chosen, dim)))
    output = narrowed(getattr(module, names["output"]), columns=rows(query_heads, value_dim))
    if not first and output.bias is not None:
        output.bias.data.zero_()
    setattr(narrow, names["output"], output)
    for name, child in module.named_children():  # gates per query head: [C] -> [H * d]
        per_head = child.out_features // heads if isinstance(child, nn.Linear) else 0
        if name not in names.values() and per_head in (qk_dim, value_dim, 1) and per_head * heads == child.out_features:
            setattr(narrow, name, narrowed(child, rows=rows(query_heads, per_head)))
    for name, parameter in module.named_parameters(recurse=False):  # sinks and other [H, ...] parameters
        if parameter.shape[:1] == (heads,):
            setattr(narrow, name, nn.Parameter(parameter.detach()[query_heads].clone()))
    counts = (len(query_heads), len(query_heads), len(kv), len(query_heads) // len(kv))
    for attribute, count in zip(HEAD_COUNTS, counts, strict=True):
        if hasattr(narrow, attribute):
            setattr(narrow, attribute, count)
    for attribute in WIDTHS:
        if getattr(narrow, attribute, None) == heads * value_dim:
            setattr(narrow, attribute, len(query_heads) * value_dim)
    return narrow


def chunked_output(
    module: nn.Module, names: dict[str, str], heads: int, kv_heads: int, args: tuple, kwargs: dict[str, Any]
) -> Tensor:
    """``module(*args, **kwargs)``'s output ``[B, N, C]`` computed as the sum over :func:`head_chunks` of
    :func:`chunk_of` the module."""
    total: Tensor | None = None
    for index, chunk in enumerate(head_chunks(heads, kv_heads)):
        out = chunk_of(module, names, heads, chunk, first=index == 0)(*args, **kwargs)
        out = out[0] if isinstance(out, tuple) else out
        total = out if total is None else total + out
    assert total is not None
    return total


def survey(model_type: str) -> dict[str, Any]:
    """One family's row: ``family``, ``verdict``, ``detail`` (the module and its head counts, or what failed)."""
    from tests.zoo_configs import tiny_recipe

    row: dict[str, Any] = {"family": model_type, "verdict": "not run", "detail": ""}
    try:
        recipe = tiny_recipe(model_type)
        model = recipe.build("eager").eval()
    except Exception as exc:  # noqa: BLE001 - a family whose tiny model does not build is reported, not fatal
        return {**row, "detail": f"not built: {type(exc).__name__}"}
    found = next(((name, m, p) for name, m in model.named_modules() if (p := projections(m)) is not None), None)
    if found is None:
        return {**row, "verdict": "other layout"}
    name, module, names = found
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
    heads = getattr(module, "num_heads", None) or model.config.get_text_config().num_attention_heads
    query_features = getattr(module, names["query"]).out_features
    head_dim = getattr(module, "head_dim", None) or query_features // heads
    if query_features != heads * head_dim:
        detail = f"`{name}`: a query projection of {query_features} features for {heads} heads of {head_dim}"
        return {**row, "verdict": "fails", "detail": detail}
    kv_heads = getattr(module, names["key"]).out_features // head_dim
    detail = f"`{name}`, heads {heads}, K/V heads {kv_heads}"
    try:
        with torch.no_grad():
            got = chunked_output(module, names, heads, kv_heads, args, kwargs)
        error = ((got - expected).norm() / expected.norm()).item()
    except Exception as exc:  # noqa: BLE001
        return {**row, "verdict": "fails", "detail": f"{detail}: {type(exc).__name__}: {str(exc).splitlines()[0][:90]}"}
    verdict = "equal" if error < TOLERANCE else "differs"
    return {**row, "verdict": verdict, "detail": f"{detail}, relative error {error:.1e}"}


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
