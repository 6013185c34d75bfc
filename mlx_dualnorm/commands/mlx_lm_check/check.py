"""The check of ``mlx-lm-check``: greedy generation unpatched, then patched,
compared (:func:`run_check`), and its report (:func:`format_result`)."""

from __future__ import annotations

import dataclasses
import statistics
from typing import Callable, Optional

import mlx.core as mx
import mlx.nn as nn

from mlx_dualnorm import Mode
from mlx_dualnorm.commands.shared import command
from mlx_dualnorm.commands.shared.generation import (
    GreedyTrace, PatchCallCounts, TraceComparison, compare_traces, count_normalize_qk_calls,
    greedy_generate,
)
from mlx_dualnorm.integrations import mlx_lm as integration

WARM_UP_TOKENS = 2
DEFAULT_TIMING_ROUNDS = 3
# The attention layers engaged, by prework kind: these three always, in this order.
PREWORK_LABELS = {
    integration.NORM_ONLY: "norm-only", integration.NORM_ROPE: "norm + RoPE",
    integration.ROPE_ONLY: "RoPE-only",
}


@dataclasses.dataclass
class CheckResult:
    reference: GreedyTrace
    patched: GreedyTrace
    comparison: TraceComparison
    counts: PatchCallCounts
    engagement: integration.LayerEngagement  # the patch's own record, read while patched
    reference_repeat: Optional[TraceComparison] = None  # only after a divergence
    # Median ms per decode token of each timing round (the checked runs are
    # the first round), both ways: one round's ratio is noise on a busy CPU.
    unpatched_round_ms: list[float] = dataclasses.field(default_factory=list)
    patched_round_ms: list[float] = dataclasses.field(default_factory=list)


def run_check(
    model: nn.Module, prompt: mx.array, max_tokens: int, mode: Optional[Mode] = None,
    timing_rounds: int = DEFAULT_TIMING_ROUNDS, progress: Optional[Callable[[str], None]] = None,
) -> CheckResult:
    """Unpatched, then patched (``mode``), greedy generation; compared. A short
    warm-up each way first, so first-token times compare like with like. The
    compared runs are the first of ``timing_rounds``; the others run both ways
    again, in alternating order. ``progress`` hears of each generation run."""
    run_done = progress or (lambda detail: None)

    def generate(patched: bool, detail: str) -> GreedyTrace:
        with integration.patch(mode) if patched else integration.unpatch():
            trace = greedy_generate(model, prompt, max_tokens)
        run_done(detail)
        return trace

    with integration.unpatch():
        try:
            greedy_generate(model, prompt, WARM_UP_TOKENS)
        except Exception as error:  # mlx-lm's own run of it: the model cannot run here
            raise command.Unavailable(
                f"mlx-lm cannot run this model here, unpatched: {command.cause(error)}"
            ) from error
    run_done("unpatched warm-up")
    with integration.patch(mode), integration.recording() as record:
        greedy_generate(model, prompt, WARM_UP_TOKENS)
    run_done("patched warm-up")
    reference = generate(False, "unpatched, compared")
    with integration.patch(mode), count_normalize_qk_calls() as counts:
        patched = greedy_generate(model, prompt, max_tokens)
        engagement = record.engagement(model)
    run_done("patched, compared")
    result = CheckResult(
        reference, patched, compare_traces(reference, patched), counts, engagement,
        unpatched_round_ms=[reference.median_decode_ms],
        patched_round_ms=[patched.median_decode_ms],
    )
    if not result.comparison.identical:
        result.reference_repeat = compare_traces(reference, generate(False, "unpatched rerun"))
    for round_index in range(1, timing_rounds):
        for patched_round in (True, False) if round_index % 2 else (False, True):
            way = "patched" if patched_round else "unpatched"
            trace = generate(patched_round, f"timing round {round_index + 1}, {way}")
            rounds = result.patched_round_ms if patched_round else result.unpatched_round_ms
            rounds.append(trace.median_decode_ms)
    return result


def format_result(result: CheckResult, model_name: str, prompt_length: int) -> str:
    comparison, counts, engagement = result.comparison, result.counts, result.engagement
    model_steps = max(len(result.patched.step_logits), 1)
    # The model has gated-delta layers where its steps called mlx-lm's
    # normalize_qk (folded or not): only then does it get gated-delta lines.
    gated_delta = counts.calls > 0
    prework_layers = {kind: 0 for kind in PREWORK_LABELS} | engagement.engaged_by_prework()
    engaged = "; ".join(
        f"{PREWORK_LABELS.get(kind, kind)} layers {count}" for kind, count in prework_layers.items()
    )
    if gated_delta:
        engaged = (
            f"gated-delta calls folded {counts.folded} "
            f"({counts.folded / model_steps:.1f} per step); {engaged}"
        )
    lines = [
        f"mlx-lm-check: {model_name} on {mx.default_device()} "
        f"(MLX {getattr(mx, '__version__')}), "  # __version__ is not in MLX's type stubs
        f"prompt {prompt_length} tokens, {len(result.reference.token_ids)} greedy tokens",
        "  token ids:      " + (
            "identical" if comparison.tokens_identical
            else f"DIVERGE at token {comparison.first_token_divergence}"
        ),
        "  logits:         " + (
            f"bit-identical at all {comparison.steps} steps" if comparison.logits_bit_identical
            else f"DIFFER from step {comparison.first_logits_divergence} "
            f"(max |difference| {comparison.max_abs_logit_difference:.6g})"
        ),
        *([f"  normalize_qk:   {counts.calls / model_steps:.1f} calls per step, "
           f"{counts.folded} folded, {counts.original} ran mlx-lm's function"]
          if gated_delta else []),
        f"  engaged:        {engaged}",
        *(f"    {layers} {prework}: {class_name}"
          for (class_name, prework), layers in sorted(engagement.engaged.items())),
        f"  left to mlx-lm: attention layers {engagement.left_layers}",
        *(f"    {layers} {class_name}: {reason}"
          for (class_name, reason), layers in sorted(engagement.left.items())),
        f"  attention:      attention layers engaged {engagement.engaged_layers}, "
        f"left to mlx-lm's code {engagement.left_layers}; "
        f"{counts.package_calls / model_steps:.1f} q/k prework calls per step",
        f"  ms per token:   unpatched {_median_text(result.unpatched_round_ms)}, "
        f"patched {_median_text(result.patched_round_ms)} (median over rounds of the "
        f"median over decode tokens); {_ratio_text(result)}",
        f"  first token:    unpatched {1e3 * result.reference.first_token_seconds:.1f} ms, "
        f"patched {1e3 * result.patched.first_token_seconds:.1f} ms (includes prompt processing)",
    ]
    if counts.folded == 0 and engagement.engaged_layers == 0:
        lines.append(
            "  note: no layer of this model ran the package's code (no gated-delta "
            "layers, no covered full-attention layer); the patch changes nothing for it"
        )
    if result.reference_repeat is not None:
        lines.append("  unpatched rerun: " + (
            "identical to the first, so the PATCH changed the output"
            if result.reference_repeat.identical
            else "differs from the first too: the model itself is not deterministic here"
        ))
    lines.append("RESULT: " + ("identical" if comparison.identical else "DIVERGED"))
    return "\n".join(lines)


def _median_text(milliseconds: list[float]) -> str:
    return f"{statistics.median(milliseconds):.3f}" if milliseconds else "n/a"


def _ratio_text(result: CheckResult) -> str:
    """The ratio of the medians printed beside it, the per-round ratios'
    range and count, and whether that range makes the ratio noise."""
    ratio = command.ratio_of_medians(result.patched_round_ms, result.unpatched_round_ms)
    ratios = [
        patched / unpatched
        for unpatched, patched in zip(result.unpatched_round_ms, result.patched_round_ms)
        if unpatched > 0 and patched > 0
    ]
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
