"""The released mlx-lm versions the package claims: the table of what
patch() engages on each (docs/mlx-lm.md, "Supported mlx-lm"), read and
computed, and greedy decoding of a synthetic model with mlx-lm's default,
rotating and batched caches, on whichever release is first on the path."""

from __future__ import annotations

import pathlib
import re
import warnings

import mlx.core as mx

from helpers.greedy_traces import greedy_logits

DOCS = pathlib.Path(__file__).resolve().parents[2] / "docs" / "mlx-lm.md"
README = DOCS.parents[1] / "README.md"
TABLE_HEADER = "| mlx-lm | attention classes patched | `normalize_qk` folded | left to their own code |"
MODELS_PREFIX = "mlx_lm.models."
CACHE_KINDS = ("default", "rotating", "batched")
ROTATING_SIZE = 16


def table_rows() -> dict[str, tuple[str, str, str]]:
    """release -> (classes patched, folded, left) as docs/mlx-lm.md's table
    writes them."""
    lines = DOCS.read_text().splitlines()
    start = lines.index(TABLE_HEADER) + 2
    rows = {}
    for line in lines[start:]:
        if not line.startswith("|"):
            break
        release, patched, folded, left = (cell.strip() for cell in line.strip("|").split("|"))
        rows[release] = (patched, folded, left)
    return rows


def computed_row() -> tuple[str, str, str]:
    """(classes patched, folded, left) for the mlx-lm first on the path, as
    patch() does it now; the patch is left on."""
    from mlx_dualnorm.integrations import mlx_lm as integration
    from mlx_dualnorm.integrations.mlx_lm import engine, registry
    from mlx_dualnorm.integrations.mlx_lm.state import STATE

    STATE.warned_unproven = False
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        integration.patch()
    present = registry.families_by_class()
    patched = engine.patched_classes()
    left = []
    for warning in caught:
        for line in str(warning.message).splitlines()[1:]:
            left.append(line.strip().split(": ", 1)[0].removeprefix(MODELS_PREFIX))
    folded = "yes" if registry.NORMALIZE_QK_PIECE.removeprefix(MODELS_PREFIX) not in left else "no"
    return (
        f"{len(patched)} of {len(present)}", folded,
        ", ".join(f"`{name}`" for name in sorted(left)) or "none",
    )


def supported_line() -> str:
    """README's sentence that names the supported releases."""
    text = " ".join(README.read_text().split())
    match = re.search(r"Supported: (mlx-lm [^(]*?) \(", text)
    assert match, "README.md has no 'Supported: mlx-lm ...' sentence"
    return match.group(1).strip()


def _batched(caches, padding):
    """mlx-lm's caches of one sequence as the batched caches its batch
    generation makes from them, or None for a cache it cannot batch."""
    from mlx_lm.models import cache as cache_module

    converted = []
    for cache in caches:
        kind = type(cache)
        if kind is cache_module.KVCache:
            converted.append(cache_module.BatchKVCache(padding))
        elif kind is cache_module.RotatingKVCache and cache.keep == 0:
            converted.append(cache_module.BatchRotatingKVCache(cache.max_size, padding))
        elif isinstance(cache, cache_module.ArraysCache):
            cache.left_padding = mx.array(padding)
            converted.append(cache)
        elif isinstance(cache, cache_module.CacheList):
            inner = _batched(cache.caches, padding)
            if inner is None:
                return None
            converted.append(cache_module.CacheList(*inner))
        else:
            return None
    return converted


def decode(model, kind: str, prompt, steps: int = 5):
    """Greedy logits of ``model`` over ``prompt`` (token ids) then ``steps``
    tokens, with mlx-lm's default caches, rotating caches of
    :data:`ROTATING_SIZE` or batched caches of two left-padded sequences;
    None where the model's caches cannot be batched."""
    from mlx_lm.models.cache import make_prompt_cache

    tokens = [int(token) for token in prompt]
    if kind == "batched":
        padding = [0, 3]
        rows = mx.array([tokens, [0] * 3 + tokens[3:]])
        caches = _batched(make_prompt_cache(model), padding)
        if caches is None:
            return None
    else:
        rows = mx.array([tokens])
        caches = make_prompt_cache(
            model, **({"max_kv_size": ROTATING_SIZE} if kind == "rotating" else {})
        )
    return greedy_logits(model, rows, caches, steps)
