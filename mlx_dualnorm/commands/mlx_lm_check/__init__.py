"""``python -m mlx_dualnorm mlx-lm-check``: greedy generation through mlx-lm
unpatched, then patched, compared token for token and logit bit for bit, on a
LOCAL model folder (never downloaded) or a small random model. Exit status: 0
identical, 1 diverged, 2 bad arguments or an unloadable model."""

from __future__ import annotations

import argparse
import dataclasses
import statistics
from pathlib import Path
from typing import Callable, Optional, Sequence

import mlx.core as mx
import mlx.nn as nn

from mlx_dualnorm import Mode
from mlx_dualnorm.commands.shared import command
from mlx_dualnorm.commands.shared.command import Unavailable
from mlx_dualnorm.commands.shared.generation import (
    GreedyTrace, PatchCallCounts, TraceComparison, compare_traces, count_normalize_qk_calls,
    greedy_generate, refuse_what_cannot_patch,
)
from mlx_dualnorm.commands.shared.synthetic import (
    DEFAULT_SEED, SYNTHETIC_MODEL_TYPES, build_synthetic_model, prompt_token_ids,
    synthetic_model_config,
)
from mlx_dualnorm.integrations import mlx_lm as integration

EXIT_IDENTICAL = command.EXIT_OK
DTYPES = {"float32": mx.float32, "float16": mx.float16, "bfloat16": mx.bfloat16}
# The bounds of a run: every run processes the prompt again (on a CPU a prompt of
# 4096 tokens, two of mlx-lm's 2048-token prefill chunks, takes minutes a run), every
# compared run keeps a vocabulary of logits per token, and every round runs both ways.
MAX_PROMPT_TOKENS = 4096
MAX_TOKENS = 1024
MAX_TIMING_ROUNDS = 100
DEFAULT_TIMING_ROUNDS = 3
WARM_UP_TOKENS = 2
LONG_PROMPT_TOKENS = 256  # from here on, each generation run is a progress line on stderr
TOKENIZER_FILES = (  # a Hugging Face tokenizer's files, one of which --prompt needs
    "tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json", "vocab.txt",
    "spiece.model",
)
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
            raise Unavailable(
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


def cpu_refusal(model: nn.Module) -> Optional[str]:
    """Why the default device cannot run ``model``, or None. MLX's CPU
    gather_mm, the matmul of mlx-lm's unquantized experts (SwitchLinear),
    takes float32 only and fails mid-run on anything else."""
    if mx.default_device().type != mx.cpu:
        return None
    from mlx_lm.models.switch_layers import SwitchLinear

    dtypes = sorted({
        str(module.weight.dtype).rsplit(".", 1)[-1]
        for module in model.modules()
        if isinstance(module, SwitchLinear) and module.weight.dtype != mx.float32
    })
    if not dtypes:
        return None
    return (
        f"its experts' weights are {', '.join(dtypes)}, and MLX's CPU gather_mm (the "
        "experts' matmul) takes float32 only: on a CPU use float32 weights "
        "(--dtype float32 for a synthetic model), or --device gpu"
    )


def _load_local_model(path_text: str) -> tuple[nn.Module, dict, Path]:
    """mlx_lm.utils.load_model on an existing folder; never downloads."""
    try:
        path = Path(path_text).expanduser()
        exists = path.exists()
        has_config = exists and path.is_dir() and (path / "config.json").is_file()
    except (RuntimeError, OSError) as unusable:  # "~nouser/x", a name too long, ...
        raise Unavailable(f"no model folder at {path_text}: {command.cause(unusable)}") from None
    if not exists:
        raise Unavailable(
            f"no model folder at {path}: give the path of a local mlx-lm model "
            "(config.json and model*.safetensors); this check never downloads"
        )
    if not has_config:
        raise Unavailable(f"{path} is not an mlx-lm model folder: it has no config.json")
    from mlx_lm.utils import load_model

    try:
        model, config = load_model(path)
    except Exception as error:  # whatever the config, weights or model class raise
        raise Unavailable(f"mlx-lm could not load {path}: {command.cause(error)}") from error
    model.eval()
    return model, config, path


def _encoded_prompt(folder: Path, text: str) -> mx.array:
    """``--prompt``, encoded with the folder's own tokenizer."""
    if not any((folder / name).is_file() for name in TOKENIZER_FILES):
        raise Unavailable(
            f"{folder} has no tokenizer (none of {', '.join(TOKENIZER_FILES)}), so --prompt "
            "cannot be encoded; leave --prompt out to use a fixed prompt of token ids"
        )
    from mlx_lm.utils import load_tokenizer

    try:
        token_ids = list(load_tokenizer(folder).encode(text))
    except Exception as error:  # whatever transformers raises for a broken tokenizer
        raise Unavailable(f"mlx-lm could not load the tokenizer of {folder}: {error}") from error
    if not token_ids:
        raise Unavailable(f"the tokenizer of {folder} encodes the prompt {text!r} to no tokens")
    if len(token_ids) > MAX_PROMPT_TOKENS:
        raise Unavailable(
            f"the prompt encodes to {len(token_ids)} tokens; at most {MAX_PROMPT_TOKENS}"
        )
    return mx.array(token_ids)


def fixed_prompt(config: dict, length: int) -> mx.array:
    """``length`` token ids below the config's vocab_size (or its text_config's; else 1000)."""
    for source in (config, config.get("text_config")):
        vocabulary = source.get("vocab_size") if isinstance(source, dict) else None
        if isinstance(vocabulary, int) and vocabulary > 1:
            return prompt_token_ids(vocabulary, length)
    return prompt_token_ids(1000, length)


def build_parser() -> argparse.ArgumentParser:
    parser = command.tool_parser(
        "mlx-lm-check",
        "Greedy generation through mlx-lm with and without the mlx_dualnorm patch: "
        "identical token ids and bit-identical logits (exit 0), a divergence (exit 1), "
        "or bad arguments / an unloadable model (exit 2).",
    )
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument(
        "--model", metavar="PATH",
        help="local mlx-lm model folder (config.json, model*.safetensors); never downloaded",
    )
    source.add_argument(
        "--synthetic", choices=SYNTHETIC_MODEL_TYPES, metavar="NAME",
        help="a small random model of the mlx-lm family NAME, built here: "
        f"{', '.join(SYNTHETIC_MODEL_TYPES)}",
    )
    parser.add_argument("--tokens", type=command.Count(1, MAX_TOKENS), default=64,
                        help="greedy tokens to generate")
    parser.add_argument(
        "--prompt",
        help="prompt text, encoded with the model folder's tokenizer (--model only; at most "
        f"{MAX_PROMPT_TOKENS} tokens); default: a fixed prompt of token ids",
    )
    parser.add_argument("--prompt-tokens", type=command.Count(1, MAX_PROMPT_TOKENS), default=12,
                        help="length of the fixed prompt")
    parser.add_argument(
        "--rounds", type=command.Count(1, MAX_TIMING_ROUNDS), default=DEFAULT_TIMING_ROUNDS,
        help="timing rounds, each way once per round (the first is the compared one)",
    )
    command.add_mode_argument(parser)
    parser.add_argument("--dtype", choices=tuple(DTYPES),
                        help="--synthetic only: weight dtype (default per model)")
    parser.add_argument("--seed", type=command.seed,
                        help=f"--synthetic only: weight seed, {DEFAULT_SEED} unless given")
    command.add_device_argument(parser)
    return parser


def main(argv: Optional[Sequence[str]] = None) -> int:
    return command.run_tool(build_parser(), _run, argv)


def _run(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    command.select_device(args.device, parser)
    refuse_what_cannot_patch(args.mode)
    try:
        if args.synthetic is not None:
            if args.prompt is not None:
                raise Unavailable("--prompt needs --model (synthetic models have no tokenizer)")
            model = build_synthetic_model(
                args.synthetic, seed=DEFAULT_SEED if args.seed is None else args.seed,
                dtype=DTYPES[args.dtype] if args.dtype else None,
            )
            model_name = f"synthetic {args.synthetic}"
            prompt = fixed_prompt(synthetic_model_config(args.synthetic), args.prompt_tokens)
        else:
            for flag, value in (("--dtype", args.dtype), ("--seed", args.seed)):
                if value is not None:
                    raise Unavailable(f"{flag} is for --synthetic models only")
            model, config, path = _load_local_model(args.model)
            model_name = str(path)
            if args.prompt is not None:
                prompt = _encoded_prompt(path, args.prompt)
            else:
                prompt = fixed_prompt(config, args.prompt_tokens)
        refusal = cpu_refusal(model)
        if refusal is not None:
            raise Unavailable(f"{model_name} cannot run on this device: {refusal}")
    except ValueError as error:
        raise Unavailable(str(error)) from None
    progress = None
    if prompt.size >= LONG_PROMPT_TOKENS:
        runs = 2 + 2 * args.rounds  # two warm-ups, then each way once per round
        stage = f"mlx-lm-check, {prompt.size}-token prompt, runs"
        progress = command.StepProgress(stage, runs).step
    result = run_check(
        model, prompt, args.tokens, args.mode, timing_rounds=args.rounds, progress=progress
    )
    print(format_result(result, model_name, int(prompt.size)))
    return EXIT_IDENTICAL if result.comparison.identical else command.EXIT_MISMATCH
