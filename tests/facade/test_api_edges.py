"""The public API's forms: reprs that read back as the constants in use,
eps by position or keyword, and the exception classes (named from the
package, pickled whole). Refused arguments are errors/test_bad_input.py's."""

from __future__ import annotations

import pickle

import mlx.core as mx
import numpy as np
import pytest

import mlx_dualnorm
from mlx_dualnorm import (
    CompiledDualHeadNorm,
    CompiledDualHeadNormRope,
    DualHeadNormValueError,
    MlxCError,
    composed_dual_head_norm,
    composed_dual_head_norm_rope,
)


@pytest.mark.parametrize("eps, shown", [(1e-6, "1e-06"), (1e-5, "1e-05"), (0, "0.0"), (0.1, "0.1")])
def test_repr_shows_the_shortest_float32_literal(eps, shown):
    norm = CompiledDualHeadNorm(eps, mode="compiled")
    assert repr(norm) == f"CompiledDualHeadNorm(eps={shown}, mode='compiled')"
    # The literal reads back as the very float32 in use.
    assert np.float32(float(shown)) == np.float32(norm.eps)
    norm_rope = CompiledDualHeadNormRope(eps, 64, base=1e4, scale=0.1, mode="compiled")
    assert repr(norm_rope) == (
        f"CompiledDualHeadNormRope(eps={shown}, dims=64, base=10000.0, traditional=False, "
        "scale=0.1, mode='compiled')"
    )


def test_both_composed_functions_take_eps_by_position_or_keyword():
    queries, weight = mx.ones((1, 2, 4, 64)), mx.ones((64,))
    for composed, options in (
        (composed_dual_head_norm, {}),
        (composed_dual_head_norm_rope, {"dims": 64, "base": 1e4}),
    ):
        by_position = composed(queries, queries, weight, None, 1e-5, **options)
        by_keyword = composed(queries, queries, weight, None, eps=1e-5, **options)
        for positional, keyword in zip(by_position, by_keyword):
            assert mx.array_equal(positional, keyword).item()


@pytest.mark.parametrize("error_type", [MlxCError, DualHeadNormValueError])
def test_exceptions_are_named_from_the_package_and_pickle(error_type):
    assert error_type.__module__ == "mlx_dualnorm"
    assert getattr(mlx_dualnorm, error_type.__name__) is error_type
    error = error_type("dual_head_norm", "something went wrong")
    copied = pickle.loads(pickle.dumps(error))
    assert type(copied) is error_type
    assert (copied.operation, copied.description, str(copied)) == (
        "dual_head_norm", "something went wrong", "[dual_head_norm] something went wrong"
    )


# ---- Objects whose own __new__ never ran ----------------------------------------


@pytest.mark.parametrize("cls", [CompiledDualHeadNorm, CompiledDualHeadNormRope])
def test_an_object_made_by_object_new_is_uninitialized_not_broken(cls):
    """``object.__new__(cls)`` skips the class's ``__new__`` and leaves the
    handle's slot empty: its repr once raised AttributeError."""
    made = object.__new__(cls)
    assert repr(made) == f"{cls.__name__}(<uninitialized>)"
    for use in (lambda: made.eps, made.close, made.__enter__):
        with pytest.raises(TypeError, match="was never initialized"):
            use()
    with pytest.raises(AttributeError, match="no attribute 'no_such_name'"):
        made.no_such_name  # noqa: B018  (other names are missing as ever)
    options = {} if cls is CompiledDualHeadNorm else {"dims": 64, "base": 1e4}
    made.__init__(1e-6, mode="compiled", **options)  # and __init__ still makes it whole
    assert repr(made).startswith(f"{cls.__name__}(eps=1e-06")
