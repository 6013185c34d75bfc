"""Every released mlx-lm the package claims, on whichever is first on the
path (the installed 0.32.2 by default; scripts/test_mlx_lm_releases.sh
runs this file once per release, each installed with ``--no-deps
--target`` and first on PYTHONPATH): what patch() engages is the table's
row for that release, and every family the release has decodes greedily
bit-identically patched and unpatched with mlx-lm's default, rotating and
batched caches."""

from __future__ import annotations

import os

import pytest

pytest.importorskip("mlx_lm")

import mlx_lm  # noqa: E402

from helpers.bit_parity import assert_bit_identical  # noqa: E402
from helpers.mlx_lm_releases import (  # noqa: E402
    CACHE_KINDS,
    computed_row,
    decode,
    supported_line,
    table_rows,
)
from mlx_dualnorm.integrations import mlx_lm as integration  # noqa: E402
from helpers.mlx_lm_families import (  # noqa: E402
    SYNTHETIC_MODEL_TYPES,
    build_synthetic_model,
    prompt_token_ids,
)

pytestmark = pytest.mark.usefixtures("unpatched_mlx_lm")

# The release the script put first on the path: a run that finds another
# one fails rather than prove the wrong release.
EXPECTED_RELEASE = os.environ.get("MLX_DUALNORM_MLX_LM_RELEASE")
RELEASES = ("0.30.7", "0.31.3", "0.32.0", "0.32.1", "0.32.2")
PROMPT = prompt_token_ids(512, 10)


def test_the_release_first_on_the_path_is_the_one_asked_for():
    if EXPECTED_RELEASE is None:
        pytest.skip("MLX_DUALNORM_MLX_LM_RELEASE is not set (the release script sets it)")
    assert mlx_lm.__version__ == EXPECTED_RELEASE, mlx_lm.__file__


def test_the_table_has_a_row_for_every_release_and_the_readme_names_them():
    rows = table_rows()
    assert tuple(sorted(rows, key=lambda r: tuple(map(int, r.split("."))))) == RELEASES
    assert supported_line() == (
        f"mlx-lm {', '.join(RELEASES[:-1])} and {RELEASES[-1]}"
    )


def test_what_patch_engages_is_the_table_s_row_for_this_release():
    rows = table_rows()
    assert mlx_lm.__version__ in rows, f"docs/mlx-lm.md has no row for {mlx_lm.__version__}"
    computed = computed_row()
    row = "| " + " | ".join((mlx_lm.__version__, *computed)) + " |"
    assert computed == rows[mlx_lm.__version__], f"the row for this release is:\n{row}"


def _model_or_skip(model_type):
    try:
        return build_synthetic_model(model_type)
    except (ModuleNotFoundError, ValueError) as error:
        if f"mlx_lm.models.{model_type.split('-')[0]}" in str(error) or "not supported" in str(
                error):
            pytest.skip(f"mlx-lm {mlx_lm.__version__} has no {model_type}")
        raise


@pytest.mark.parametrize("kind", CACHE_KINDS)
@pytest.mark.parametrize("model_type", SYNTHETIC_MODEL_TYPES)
def test_every_family_decodes_bit_identically(model_type, kind):
    model = _model_or_skip(model_type)
    try:
        reference = decode(model, kind, PROMPT)
    except Exception as error:  # what this release's own code cannot run
        with integration.patch(), pytest.raises(type(error)):
            decode(model, kind, PROMPT)  # raises as unpatched
        return
    if reference is None:
        pytest.skip(f"{model_type}'s caches do not batch")
    with integration.patch():
        patched = decode(model, kind, PROMPT)
    for step, (actual, expected) in enumerate(zip(patched, reference)):
        assert_bit_identical(actual, expected, f"{model_type} {kind} step {step}")
