"""The check of ``mlx-lm-check``: greedy generation unpatched, then
patched, compared (:func:`run_check`), and its report
(:func:`format_result`)."""

from __future__ import annotations

import dataclasses
import statistics
from typing import Callable, Optional

import mlx.core as mx
import mlx.nn as nn

from mlx_dualnorm import Mode
from mlx_dualnorm.commands.shared import command
from mlx_dualnorm.commands.shared.generation import (
    AttentionLayerCounts, GreedyTrace, NormalizeQkCallCounts, TraceComparison,
    compare_traces, count_normalize_qk_calls, count_package_calls, greedy_generate,
)
from mlx_dualnorm.integrations.mlx_lm import (
    NORM_ONLY,
    NORM_ROPE,
    ROPE_ONLY,
    LayerEngagement,
    recording,
)
from mlx_dualnorm.integrations import mlx_lm as integration

__all__ = ["CheckResult", "format_result", "run_check"]

WARM_UP_TOKENS = 2
DEFAULT_TIMING_ROUNDS = 3


@dataclasses.dataclass
class CheckResult:
    reference: GreedyTrace
    patched: GreedyTrace
    comparison: TraceComparison
    counts: NormalizeQkCallCounts
    attention: AttentionLayerCounts
    engagement: LayerEngagement  # the patch's own record, read while patched
    reference_repeat: Optional[TraceComparison] = None  # only after a divergence
    # Median ms per decode token of each timing round (the checked runs are
    # the first round), both ways: one round's ratio is noise on a busy CPU.
    unpatched_round_ms: list[float] = dataclasses.field(default_factory=list)
    patched_round_ms: list[float] = dataclasses.field(default_factory=list)

    @property
    def round_time_ratios(self) -> list[float]:
        """Per round, patched / unpatched median ms per token."""
        return [
            patched / unpatched
            for unpatched, patched in zip(self.unpatched_round_ms, self.patched_round_ms)
            if unpatched > 0 and patched > 0
        ]


def run_check(
    model: nn.Module,
    prompt: mx.array,
    max_tokens: int,
    mode: Optional[Mode] = None,
    timing_rounds: int = DEFAULT_TIMING_ROUNDS,
    progress: Optional[Callable[[str], None]] = None,
) -> CheckResult:
    """Unpatched, then patched (``mode``), greedy generation; compared. A
    short run each way first warms both up (compiles, folds, allocator), so
    the first-token times compare like with like. The compared runs are the
    first of ``timing_rounds`` timing rounds; the others run both ways again,
    the order alternating, for the spread of the time ratio. ``progress``
    is called after each generation run with what it was."""
    run_done = progress or (lambda detail: None)
    with integration.unpatch():
        try:
            greedy_generate(model, prompt, WARM_UP_TOKENS)
        except Exception as error:  # mlx-lm's own run of it: the model cannot run here
            raise command.Unavailable(
                f"mlx-lm cannot run this model here, unpatched: {command.cause(error)}"
            ) from error
    run_done("unpatched warm-up")
    with integration.patch(mode), recording() as record:
        greedy_generate(model, prompt, WARM_UP_TOKENS)
    run_done("patched warm-up")
    with integration.unpatch():
        reference = greedy_generate(model, prompt, max_tokens)
    run_done("unpatched, compared")
    with integration.patch(mode), count_normalize_qk_calls() as counts, \
            count_package_calls() as attention:
        patched = greedy_generate(model, prompt, max_tokens)
        engagement = record.engagement(model)
    run_done("patched, compared")
    result = CheckResult(
        reference, patched, compare_traces(reference, patched), counts, attention,
        engagement,
    )
    if not result.comparison.identical:
        with integration.unpatch():
            repeat = greedy_generate(model, prompt, max_tokens)
        run_done("unpatched rerun")
        result.reference_repeat = compare_traces(reference, repeat)
    result.unpatched_round_ms.append(reference.median_decode_ms)
    result.patched_round_ms.append(patched.median_decode_ms)
    for round_index in range(1, timing_rounds):
        order = (True, False) if round_index % 2 else (False, True)
        for patched_round in order:
            with integration.patch(mode) if patched_round else integration.unpatch():
                milliseconds = greedy_generate(model, prompt, max_tokens).median_decode_ms
            run_done(f"timing round {round_index + 1}, {'patched' if patched_round else 'unpatched'}")
            rounds = result.patched_round_ms if patched_round else result.unpatched_round_ms
            rounds.append(milliseconds)
    return result


def format_result(result: CheckResult, model_name: str, prompt_length: int) -> str:
    comparison = result.comparison
    tokens = len(result.reference.token_ids)
    model_steps = max(len(result.patched.step_logits), 1)
    mlx_version = getattr(mx, "__version__")  # not in MLX's type stubs
    lines = [
        f"mlx-lm-check: {model_name} on {mx.default_device()} (MLX {mlx_version}), "
        f"prompt {prompt_length} tokens, {tokens} greedy tokens",
        "  token ids:      "
        + (
            "identical"
            if comparison.tokens_identical
            else f"DIVERGE at token {comparison.first_token_divergence}"
        ),
        f"  logits:         "
        + (
            f"bit-identical at all {comparison.steps} steps"
            if comparison.logits_bit_identical
            else f"DIFFER from step {comparison.first_logits_divergence} "
            f"(max |difference| {comparison.max_abs_logit_difference:.6g})"
        ),
        *(
            [
                f"  normalize_qk:   {result.counts.calls / model_steps:.1f} calls per step, "
                f"{result.counts.folded} folded, {result.counts.original} ran mlx-lm's function"
            ]
            if _has_gated_delta_layers(result)
            else []
        ),
        *_engagement_lines(result, model_steps),
        f"  ms per token:   unpatched {_median_text(result.unpatched_round_ms)}, "
        f"patched {_median_text(result.patched_round_ms)} (median over rounds of the "
        f"median over decode tokens); {_ratio_text(result)}",
        f"  first token:    unpatched {1e3 * result.reference.first_token_seconds:.1f} ms, "
        f"patched {1e3 * result.patched.first_token_seconds:.1f} ms (includes prompt processing)",
    ]
    if result.counts.folded == 0 and result.engagement.engaged_layers == 0:
        lines.append(
            "  note: no layer of this model ran the package's code (no gated-delta "
            "layers, no covered full-attention layer); the patch changes nothing for it"
        )
    if result.reference_repeat is not None:
        lines.append(
            "  unpatched rerun: "
            + (
                "identical to the first, so the PATCH changed the output"
                if result.reference_repeat.identical
                else "differs from the first too: the model itself is not deterministic here"
            )
        )
    lines.append("RESULT: " + ("identical" if comparison.identical else "DIVERGED"))
    return "\n".join(lines)


def _has_gated_delta_layers(result: CheckResult) -> bool:
    """Whether the model has gated-delta layers: their every step calls
    mlx-lm's ``normalize_qk``, which the patched run counted (folded or
    not); a model without them gets no gated-delta lines."""
    return result.counts.calls > 0


def _engagement_lines(result: CheckResult, model_steps: int) -> list[str]:
    """What the patch engaged, by count: gated-delta calls folded (for a
    model with gated-delta layers), attention layers by prework and class,
    and those left to mlx-lm's code with the reason."""
    engagement = result.engagement
    by_prework = engagement.engaged_by_prework()
    others = "".join(
        f"; {prework} layers {layers}"
        for prework, layers in by_prework.items()
        if prework not in (NORM_ONLY, NORM_ROPE, ROPE_ONLY)
    )
    gated_delta_part = (
        f"gated-delta calls folded {result.counts.folded} "
        f"({result.counts.folded / model_steps:.1f} per step); "
        if _has_gated_delta_layers(result)
        else ""
    )
    lines = [
        f"  engaged:        {gated_delta_part}"
        f"norm-only layers {by_prework.get(NORM_ONLY, 0)}; "
        f"norm + RoPE layers {by_prework.get(NORM_ROPE, 0)}; "
        f"RoPE-only layers {by_prework.get(ROPE_ONLY, 0)}{others}",
    ]
    for (class_name, prework), layers in sorted(engagement.engaged.items()):
        lines.append(f"    {layers} {prework}: {class_name}")
    lines.append(f"  left to mlx-lm: attention layers {engagement.left_layers}")
    for (class_name, reason), layers in sorted(engagement.left.items()):
        lines.append(f"    {layers} {class_name}: {reason}")
    lines.append(
        f"  attention:      attention layers engaged {engagement.engaged_layers}, "
        f"left to mlx-lm's code {engagement.left_layers}; "
        f"{result.attention.package_calls / model_steps:.1f} q/k prework calls per step"
    )
    return lines


def _median_text(milliseconds: list[float]) -> str:
    return f"{statistics.median(milliseconds):.3f}" if milliseconds else "n/a"


def _ratio_text(result: CheckResult) -> str:
    """patched / unpatched: the ratio of the medians printed beside it,
    then the per-round ratios' range and the number of rounds, and, where
    that range spans 1.0 (some rounds faster, some slower), that the ratio
    measures no speed-up or slow-down. One round has no range: it says so."""
    ratio = command.ratio_of_medians(result.patched_round_ms, result.unpatched_round_ms)
    ratios = result.round_time_ratios
    if ratio is None or not ratios:
        return "patched / unpatched n/a"
    text = (
        f"patched / unpatched {ratio:.2f}x (per round {min(ratios):.2f}..{max(ratios):.2f}, "
        f"{len(ratios)} round{'s' if len(ratios) != 1 else ''}), lower is better"
    )
    if len(ratios) == 1:
        return text + "; one round has no spread, so this ratio may be noise (--rounds 3 or more)"
    if min(ratios) <= 1.0 <= max(ratios):
        return text + (
            "; NOISE: the per-round range spans 1.0 (patched was faster in some rounds, "
            "slower in others), so this ratio is not a measured speed-up or slow-down"
        )
    return text
