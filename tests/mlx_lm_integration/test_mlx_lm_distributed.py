"""mlx-lm sharded over mx.distributed: two ranks on loopback (ring backend,
127.0.0.1 only), started by mlx.launch with this interpreter, once for the
whole module. Every family the patch engages that has ``Model.shard`` runs
tensor-parallel with the patch made before the model is built (the head
counts are divided after ``patch()``) and with the patch made only after
``shard()``, and pipeline-parallel where the family has ``pipeline``, each
patched and unpatched, greedy through mlx-lm's ``generate_step``.

What holds, as measured on mlx 0.32.4 / mlx-lm 0.32.2 on CPU: the patched
runs are bit-identical to the unpatched ones on every rank; the package runs
once per engaged layer and forward pass; pipeline-parallel logits are
bit-identical to the unsharded model's; tensor-parallel logits are not (the
all-sum of the sharded projections adds partial sums in another order), so
against the unsharded model they are compared as equal tokens and logits
within a few rounding steps of their dtype."""

from __future__ import annotations

import importlib
import os
import pathlib
import sys
import time

import mlx.core as mx
import pytest

pytest.importorskip("mlx_lm")
pytestmark = [pytest.mark.usefixtures("unpatched_mlx_lm"), pytest.mark.slow]

from helpers.bit_parity import assert_bit_identical  # noqa: E402

from helpers import mlx_lm_ranks as distributed  # noqa: E402

from helpers import launch as mlx_lm_launcher  # noqa: E402

RANKS = 2
TOKENS = 3
LAUNCH_TIMEOUT_S = 300.0  # the whole job takes about 40 s on 2 cores
FAMILIES = tuple(distributed.FAMILIES)
SCENARIOS = {name: (parallelism, patching) for name, parallelism, patching in distributed.SCENARIOS}
PATCHED_SCENARIOS = [name for name, (_, patching) in SCENARIOS.items()
                     if patching != distributed.PATCH_NEVER]


@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> list[tuple[dict, dict]]:
    """Per rank, (results, logits) of one ``check`` job over every family."""
    out = tmp_path_factory.mktemp("mlx_lm_distributed")
    result = mlx_lm_launcher.launch(
        ["check", "--tokens", str(TOKENS), "--out", str(out)],
        ranks=RANKS, timeout_s=LAUNCH_TIMEOUT_S, program=distributed.PROGRAM,
    )
    assert result.ok, result.describe()
    loaded = distributed.load_check_results(out, RANKS)
    assert [document["rank"] for document, _ in loaded] == list(range(RANKS))
    assert all(document["size"] == RANKS for document, _ in loaded)
    return loaded


def _runs(ranks, family: str):
    """(rank, scenario, run, logits) for every run of ``family``."""
    for rank, (document, logits) in enumerate(ranks):
        for scenario, run in document["families"][family].items():
            yield rank, scenario, run, logits[f"{family}/{scenario}"]


def _unpatched_twin(scenario: str) -> str:
    parallelism, _ = SCENARIOS[scenario]
    return f"{parallelism}_unpatched"


@pytest.mark.parametrize("family", FAMILIES)
def test_every_scenario_ran_on_every_rank(ranks, family):
    pipelines = distributed.FAMILIES[family].pipeline_owner is not None
    expected = {name for name, (parallelism, _) in SCENARIOS.items()
                if pipelines or parallelism != distributed.PIPELINE}
    for document, _ in ranks:
        assert set(document["families"][family]) == expected


@pytest.mark.parametrize("family", FAMILIES)
def test_patched_sharded_runs_match_unpatched_bit_for_bit_on_every_rank(ranks, family):
    """Tokens and the logits of every step, patched (before the build, or
    after shard()/pipeline()) vs unpatched, each rank against itself."""
    for rank, scenario, run, logits in _runs(ranks, family):
        if scenario not in PATCHED_SCENARIOS:
            continue
        twin = ranks[rank][0]["families"][family][_unpatched_twin(scenario)]
        assert run["tokens"] == twin["tokens"], (rank, scenario)
        assert_bit_identical(logits, ranks[rank][1][f"{family}/{_unpatched_twin(scenario)}"])
        assert logits.shape[0] == TOKENS + 1  # generate_step's logits, one step ahead


@pytest.mark.parametrize("family", FAMILIES)
def test_package_runs_once_per_engaged_layer_and_forward_pass_on_every_rank(ranks, family):
    """Counted calls of the package's two compiled classes: patched, one per
    gated-delta layer, covered full-attention layer and q/k norm pair layer
    of the rank, in every forward pass (no layer fell back), and at least
    one engaged layer on each rank (none where shard() swaps the norms for
    sharded ones: minimax); unpatched, none."""
    for rank, scenario, run, _ in _runs(ranks, family):
        calls, layers, forwards = run["calls"], run["layers"], run["calls"]["forward"]
        assert forwards >= TOKENS + 1, (rank, scenario, calls)
        if scenario in PATCHED_SCENARIOS:
            engaged = layers["gated_delta"] + layers["full_attention"] + layers["norm_pair"]
            if SCENARIOS[scenario][0] == distributed.TENSOR and not (
                distributed.FAMILIES[family].tensor_parallel_engages
            ):
                assert engaged == 0, (rank, scenario)
            else:
                assert engaged > 0, (rank, scenario)
            dual_norm_layers = layers["gated_delta"] + layers["norm_pair"]
            assert calls["dual_head_norm"] == forwards * dual_norm_layers, (rank, scenario)
            assert calls["dual_head_norm_rope"] == forwards * layers["full_attention"], (
                rank, scenario,
            )
        else:
            assert calls["dual_head_norm"] == calls["dual_head_norm_rope"] == 0, (rank, scenario)


@pytest.mark.parametrize("family", FAMILIES)
def test_ranks_compute_the_same_bits(ranks, family):
    """After the all-sum (tensor) or the all-gather (pipeline) every rank
    holds the whole logits, and they agree bit for bit."""
    first_document, first_logits = ranks[0]
    for document, logits in ranks[1:]:
        for scenario, run in document["families"][family].items():
            assert run["tokens"] == first_document["families"][family][scenario]["tokens"]
            key = f"{family}/{scenario}"
            assert_bit_identical(logits[key], first_logits[key])


@pytest.mark.parametrize("family", FAMILIES)
def test_pipeline_parallel_is_bit_identical_to_the_unsharded_model(ranks, family):
    """Pipeline splitting moves whole layers between ranks, no sums change
    order: patched or not, the unsharded model's bits."""
    if distributed.FAMILIES[family].pipeline_owner is None:
        pytest.skip(f"{family} has no pipeline method")
    for rank, scenario, run, logits in _runs(ranks, family):
        if SCENARIOS[scenario][0] != distributed.PIPELINE:
            continue
        reference = ranks[rank][0]["families"][family]["unsharded_unpatched"]
        assert run["tokens"] == reference["tokens"], (rank, scenario)
        assert_bit_identical(logits, ranks[rank][1][f"{family}/unsharded_unpatched"])


@pytest.mark.parametrize("family", FAMILIES)
def test_tensor_parallel_keeps_the_unsharded_tokens_and_logits_within_rounding(ranks, family):
    """Tensor-parallel projections end in an all-sum of partial products,
    added in another order than the unsharded matmul: the logits are not the
    same bits (measured), but the tokens are the same and the logits lie
    within 16 rounding steps (machine epsilon of their dtype) of the
    largest unsharded logit."""
    for rank, scenario, run, logits in _runs(ranks, family):
        if SCENARIOS[scenario][0] != distributed.TENSOR:
            continue
        reference_run = ranks[rank][0]["families"][family]["unsharded_unpatched"]
        reference = ranks[rank][1][f"{family}/unsharded_unpatched"]
        assert run["tokens"] == reference_run["tokens"], (rank, scenario)
        assert logits.dtype == reference.dtype and logits.shape == reference.shape
        difference = mx.abs(logits.astype(mx.float32) - reference.astype(mx.float32))
        bound = 16 * mx.finfo(reference.dtype).eps * mx.max(mx.abs(reference)).item()
        assert mx.max(difference).item() <= bound, (rank, scenario, mx.max(difference).item())


def test_every_engaged_family_with_shard_is_covered():
    """Scans the installed mlx-lm: every model family whose module runs
    gated-delta ``normalize_qk`` or uses an attention class the patch
    replaces, and whose Model has ``shard``, shares its ``shard`` method
    with a family this module launches."""
    import mlx_lm.models

    from mlx_dualnorm.integrations import mlx_lm as integration

    patched_classes = tuple(
        attention_class
        for attention_class in map(
            integration.AttentionFamily.attention_class, integration.attention_families()
        )
        if attention_class is not None
    )
    original = integration.ORIGINAL_NORMALIZE_QK
    covered_shards = {
        importlib.import_module(f"mlx_lm.models.{distributed.FAMILIES[name].config['model_type']}")
        .Model.shard
        for name in FAMILIES
    }
    models_folder = pathlib.Path(mlx_lm.models.__file__).parent
    uncovered = []
    for source in sorted(models_folder.glob("*.py")):
        try:
            module = importlib.import_module(f"mlx_lm.models.{source.stem}")
        except BaseException:  # a model needing an extra package: not installed here
            continue
        model_class = getattr(module, "Model", None)
        if not isinstance(model_class, type) or not hasattr(model_class, "shard"):
            continue
        # The modules of the class and of every base: a subclass in a module
        # of its own runs its base module's layers.
        values = [
            value
            for base in model_class.__mro__
            for value in vars(sys.modules[base.__module__]).values()
        ]
        engaged = any(
            value is original or getattr(value, "__wrapped__", None) is original
            for value in values
        ) or any(isinstance(value, type) and issubclass(value, patched_classes) for value in values)
        if engaged and model_class.shard not in covered_shards:
            uncovered.append(source.stem)
    assert uncovered == []


@pytest.mark.parametrize("launcher", mlx_lm_launcher.LAUNCHERS)
def test_launch_reports_a_failing_rank_although_mlx_launch_exits_0(tmp_path, launcher):
    result = mlx_lm_launcher.launch(
        ["check", "--families", "no_such_family", "--out", str(tmp_path)],
        ranks=RANKS, timeout_s=120, launcher=launcher, program=distributed.PROGRAM,
    )
    assert not result.timed_out, result.describe()
    assert not result.ok and result.failed_ranks, result.describe()
    assert "no_such_family" in result.stderr


@pytest.mark.parametrize("launcher", mlx_lm_launcher.LAUNCHERS)
def test_launch_kills_the_launcher_and_its_ranks_at_the_time_limit(tmp_path, launcher):
    result = mlx_lm_launcher.launch(
        ["check", "--tokens", "64", "--out", str(tmp_path)], ranks=RANKS, timeout_s=3,
        launcher=launcher, program=distributed.PROGRAM,
    )
    assert result.timed_out and not result.ok
    deadline = time.monotonic() + 20  # killed ranks are reaped by their new parent
    remaining = list(result.process_groups)
    while remaining and time.monotonic() < deadline:
        for group in list(remaining):
            try:
                os.killpg(group, 0)
            except ProcessLookupError:
                remaining.remove(group)
        time.sleep(0.1)
    assert remaining == [], f"processes of groups {remaining} outlived the time limit"
