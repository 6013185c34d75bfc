"""Which gradients of a one-token step after a prefill get other bits, per mode.

gemma3_text's synthetic model (the tests' shapes): an 8-token prefill of
two sequences into mlx-lm's caches, then one step, its loss differentiated
through both; without a cache, the step alone. For each of the package's
modes available here, and for a second unpatched run: the parameters whose
gradient bits differ from the first unpatched run's, and for the embedding
the rows that differ and whether only the signs of zeros do.

    python3 bench/gradient_order_probe.py
"""

from __future__ import annotations

import pathlib
import sys

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx.utils import tree_flatten

from mlx_dualnorm import available_modes
from mlx_dualnorm.bits import count_bit_differences
from mlx_dualnorm.integrations import mlx_lm as integration

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "tests"))
from helpers.mlx_lm_families import build_synthetic_model  # noqa: E402
from helpers.mlx_lm_patch import one_token_step_loss  # noqa: E402  (the tests' step)

EMBEDDING = "model.embed_tokens.weight"


def loss_and_gradients(model, with_cache: bool):
    loss, gradients = nn.value_and_grad(
        model, lambda m: one_token_step_loss(m, with_cache))(model)
    gradients = dict(tree_flatten(gradients))
    mx.eval(loss, gradients)
    return loss, gradients


def embedding_rows(actual, expected) -> str:
    actual = np.array(actual.astype(mx.float32))
    expected = np.array(expected.astype(mx.float32))
    differing = (actual != expected) | (np.signbit(actual) != np.signbit(expected))
    signed_zeros = int((differing & (actual == 0) & (expected == 0)).sum())
    rows = sorted(set(np.nonzero(differing)[0].tolist()))
    return (f"{int(differing.sum())} differ, {signed_zeros} only in a zero's sign, rows {rows}, "
            f"largest difference {np.abs(actual - expected).max():.3g}")


def main():
    model = build_synthetic_model("gemma3_text")
    modes = [mode for mode in ("fused", "compiled", "composed") if mode in available_modes()]
    for with_cache in (True, False):
        loss, reference = loss_and_gradients(model, with_cache)
        for mode in [*modes, None]:
            if mode is None:
                name, (other_loss, gradients) = "unpatched again", loss_and_gradients(model, with_cache)
            else:
                with integration.patch(mode=mode):
                    other_loss, gradients = loss_and_gradients(model, with_cache)
                name = mode
            differing = {path: count_bit_differences(gradients[path], reference[path])
                         for path in reference}
            differing = {path: count for path, count in differing.items() if count}
            print(f"cache={with_cache} {name}: loss same="
                  f"{count_bit_differences(other_loss, loss) == 0}, differing {differing}")
            if EMBEDDING in differing:
                print("   embedding:", embedding_rows(gradients[EMBEDDING], reference[EMBEDDING]))


if __name__ == "__main__":
    main()
