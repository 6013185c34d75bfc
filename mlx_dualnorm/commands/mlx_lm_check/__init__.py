"""``python -m mlx_dualnorm mlx-lm-check``: does the patch change a model's output?

Greedy-generates the same tokens twice through mlx-lm's own
``mlx_lm.generate.generate_step``, from the same prompt and a fresh cache:
first with mlx-lm's ``normalize_qk``, then under
:func:`mlx_dualnorm.integrations.mlx_lm.patch`. It reports whether the token
ids are identical and the logits bit-identical at every step, the decode
time per token both ways, how many ``normalize_qk`` calls per token went
through the fold or ran mlx-lm's function, and what the patch engaged, read
from its own record (:mod:`mlx_dualnorm.integrations.mlx_lm.engagement`):
gated-delta calls folded, norm-only and norm + RoPE attention layers by class, and
the attention layers left to mlx-lm's code with the reason. If the runs
diverge, the unpatched run is repeated, to tell a nondeterministic model
from a patch that changes results.

The model is a LOCAL mlx-lm folder (``--model PATH``: config.json and
model*.safetensors, loaded with ``mlx_lm.utils.load_model``; nothing is ever
downloaded) or one of the small random models of
:mod:`~mlx_dualnorm.commands.shared.synthetic` (``--synthetic NAME``).

Exit status: 0 identical, 1 diverged, 2 bad arguments or an unloadable model.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import statistics
import sys
import time
from pathlib import Path
from typing import Callable, Iterator, Optional, Sequence

import mlx.core as mx
import mlx.nn as nn

from mlx_dualnorm.bits import same_bits
from mlx_dualnorm import Mode
from mlx_dualnorm.commands.shared import command
from mlx_dualnorm.integrations import mlx_lm as integration
from mlx_dualnorm.commands.shared.recording import NORM_ONLY, NORM_ROPE, LayerEngagement, recording
from mlx_dualnorm.commands.shared.synthetic import (
    DEFAULT_SEED,
    SYNTHETIC_MODEL_TYPES,
    build_synthetic_model,
    prompt_token_ids,
    synthetic_model_config,
)

__all__ = [
    "GreedyTrace",
    "NormalizeQkCallCounts",
    "TraceComparison",
    "compare_traces",
    "count_normalize_qk_calls",
    "greedy_generate",
    "main",
]

PROGRAM = "python -m mlx_dualnorm mlx-lm-check"
EXIT_IDENTICAL = 0
EXIT_DIVERGED = 1
EXIT_USAGE = 2
DTYPES = {"float32": mx.float32, "float16": mx.float16, "bfloat16": mx.bfloat16}
FALLBACK_VOCABULARY = 1000  # prompt ids stay below this when the config has none
WARM_UP_TOKENS = 2
DEFAULT_TIMING_ROUNDS = 3
# The longest prompt taken (--prompt-tokens, or --prompt once encoded): two
# of mlx-lm's 2048-token prefill chunks. Each run processes the prompt
# again, and on a CPU a 4096-token prompt takes minutes a run.
MAX_PROMPT_TOKENS = 4096
# Every generated token keeps its step's logits (a vocabulary of them) in
# each compared run, and every round generates them again both ways: these
# bound the check's memory and time.
MAX_TOKENS = 1024
MAX_TIMING_ROUNDS = 100
# From this prompt length on, each generation run is a progress line on
# stderr with the time left.
LONG_PROMPT_TOKENS = 256
# The files of a Hugging Face tokenizer, one of which --prompt needs.
TOKENIZER_FILES = (
    "tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json", "vocab.txt",
    "spiece.model",
)


# ---- Greedy generation through mlx-lm -------------------------------------


@dataclasses.dataclass
class GreedyTrace:
    """One greedy generation: the yielded token ids, the raw logits of every
    model step (one more than tokens: generate_step computes the step after
    the last yielded token too), and wall times."""

    token_ids: list[int]
    step_logits: list[mx.array]
    first_token_seconds: float  # prompt processing and the first token
    decode_token_seconds: list[float]  # each later token, as yielded

    @property
    def median_decode_ms(self) -> float:
        if not self.decode_token_seconds:
            return float("nan")
        return 1e3 * statistics.median(self.decode_token_seconds)


def greedy_generate(model: nn.Module, prompt: mx.array, max_tokens: int) -> GreedyTrace:
    """``max_tokens`` greedy tokens from mlx-lm's ``generate_step``, logits
    recorded by a logits processor that returns them unchanged."""
    from mlx_lm.generate import generate_step

    try:
        from mlx_lm.sample_utils import greedy_sampler
    except ImportError:  # mlx-lm 0.31.x: its generate_step's own default, argmax

        def greedy_sampler(logprobs: mx.array) -> mx.array:
            return mx.argmax(logprobs, axis=-1)

    step_logits: list[mx.array] = []

    def record_logits(tokens: mx.array, logits: mx.array) -> mx.array:
        step_logits.append(logits)
        return logits

    token_ids: list[int] = []
    token_seconds: list[float] = []
    started = time.perf_counter()
    for token_id, _ in generate_step(
        prompt,
        model,
        max_tokens=max_tokens,
        sampler=greedy_sampler,
        logits_processors=[record_logits],
    ):
        now = time.perf_counter()
        token_seconds.append(now - started)
        started = now
        token_ids.append(int(token_id))
    mx.eval(step_logits)
    return GreedyTrace(
        token_ids=token_ids,
        step_logits=step_logits,
        first_token_seconds=token_seconds[0] if token_seconds else float("nan"),
        decode_token_seconds=token_seconds[1:],
    )


@dataclasses.dataclass
class TraceComparison:
    steps: int
    tokens_identical: bool
    first_token_divergence: Optional[int]  # index of the first differing token
    logits_bit_identical: bool
    first_logits_divergence: Optional[int]  # index of the first differing step
    max_abs_logit_difference: float

    @property
    def identical(self) -> bool:
        return self.tokens_identical and self.logits_bit_identical


def compare_traces(reference: GreedyTrace, candidate: GreedyTrace) -> TraceComparison:
    """Token ids equal and logits equal bit for bit (dtype, shape, bits); a
    length difference counts as a divergence where the shorter one ends."""
    first_token_divergence = _first_difference(
        reference.token_ids, candidate.token_ids, lambda expected, actual: expected == actual
    )
    first_logits_divergence = _first_difference(
        reference.step_logits, candidate.step_logits, same_bits
    )
    max_abs_difference = 0.0
    for expected, actual in zip(reference.step_logits, candidate.step_logits):
        if expected.shape != actual.shape:
            max_abs_difference = float("inf")
        elif not same_bits(expected, actual):
            difference = mx.abs(expected.astype(mx.float32) - actual.astype(mx.float32))
            max_abs_difference = max(max_abs_difference, float(mx.max(difference)))
    return TraceComparison(
        steps=max(len(reference.step_logits), len(candidate.step_logits)),
        tokens_identical=first_token_divergence is None,
        first_token_divergence=first_token_divergence,
        logits_bit_identical=first_logits_divergence is None,
        first_logits_divergence=first_logits_divergence,
        max_abs_logit_difference=max_abs_difference,
    )


def _first_difference(expected_items, actual_items, same) -> Optional[int]:
    for index, (expected, actual) in enumerate(zip(expected_items, actual_items)):
        if not same(expected, actual):
            return index
    if len(expected_items) != len(actual_items):
        return min(len(expected_items), len(actual_items))
    return None


# ---- Which path each normalize_qk call took --------------------------------


@dataclasses.dataclass
class NormalizeQkCallCounts:
    """Calls of the patched ``normalize_qk``: all of them, and those that
    ran mlx-lm's own function."""

    calls: int = 0
    original: int = 0

    @property
    def folded(self) -> int:
        return self.calls - self.original


@contextlib.contextmanager
def count_normalize_qk_calls() -> Iterator[NormalizeQkCallCounts]:
    """Counts the patched ``normalize_qk``'s calls while the block runs,
    from the patch's own report (what it counted when the block ended,
    less what it had counted before)."""
    counts = NormalizeQkCallCounts()
    before = integration.report()
    try:
        yield counts
    finally:
        after = integration.report()
        counts.calls = after.normalize_qk_calls - before.normalize_qk_calls
        counts.original = after.normalize_qk_original - before.normalize_qk_original


@dataclasses.dataclass
class AttentionLayerCounts:
    """The calls of engaged attention layers that ran the package's q/k
    prework (norm + RoPE, or the q/k norm pair)."""

    package_calls: int = 0


@contextlib.contextmanager
def count_package_calls() -> Iterator[AttentionLayerCounts]:
    """Counts engaged attention layers' calls that went through the package
    while the block runs, from the patch's own report."""
    counts = AttentionLayerCounts()
    before = integration.report().calls
    try:
        yield counts
    finally:
        counts.package_calls = integration.report().calls - before


# ---- The check ---------------------------------------------------------------


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
        if prework not in (NORM_ONLY, NORM_ROPE)
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
        f"norm + RoPE layers {by_prework.get(NORM_ROPE, 0)}{others}",
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


def _load_local_model(path_text: str) -> tuple[nn.Module, dict, Path]:
    """mlx_lm.utils.load_model on an existing folder; never downloads. Any
    exception while loading (its config, its weights, the model class) is
    a usage error naming the folder and the cause."""
    try:
        path = Path(path_text).expanduser()
        exists = path.exists()
        has_config = exists and path.is_dir() and (path / "config.json").is_file()
    except (RuntimeError, OSError) as unusable:  # "~nouser/x", a name too long, ...
        raise _UsageError(f"no model folder at {path_text}: {command.cause(unusable)}") from None
    if not exists:
        raise _UsageError(
            f"no model folder at {path}: give the path of a local mlx-lm model "
            "(config.json and model*.safetensors); this check never downloads"
        )
    if not has_config:
        raise _UsageError(f"{path} is not an mlx-lm model folder: it has no config.json")
    from mlx_lm.utils import load_model

    try:
        model, config = load_model(path)
        if not isinstance(config, dict):
            raise TypeError(f"config.json holds a {type(config).__name__}, not an object")
    except Exception as error:  # whatever the config, weights or model class raise
        raise _UsageError(f"mlx-lm could not load {path}: {command.cause(error)}") from error
    model.eval()
    return model, config, path


def cpu_refusal(model: nn.Module) -> Optional[str]:
    """Why the default device cannot run ``model``, or None. MLX's CPU
    gather_mm, the matmul of mlx-lm's unquantized experts (SwitchLinear,
    in every mixture-of-experts family), takes float32 only, and fails
    mid-run on anything else (the quantized gather_qmm takes them all)."""
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


class _UsageError(Exception):
    pass


def _encoded_prompt(folder: Path, text: str) -> mx.array:
    """``--prompt``: the token ids of ``text`` from the folder's own
    tokenizer; a folder without one, a tokenizer mlx-lm cannot load, or a
    prompt of no tokens or too many is a usage error."""
    if not any((folder / name).is_file() for name in TOKENIZER_FILES):
        raise _UsageError(
            f"{folder} has no tokenizer (none of {', '.join(TOKENIZER_FILES)}), so --prompt "
            "cannot be encoded; leave --prompt out to use a fixed prompt of token ids"
        )
    from mlx_lm.utils import load_tokenizer

    try:
        token_ids = list(load_tokenizer(folder).encode(text))
    except Exception as error:  # whatever transformers raises for a broken tokenizer
        raise _UsageError(f"mlx-lm could not load the tokenizer of {folder}: {error}") from error
    if not token_ids:
        raise _UsageError(f"the tokenizer of {folder} encodes the prompt {text!r} to no tokens")
    if len(token_ids) > MAX_PROMPT_TOKENS:
        raise _UsageError(
            f"the prompt encodes to {len(token_ids)} tokens; at most {MAX_PROMPT_TOKENS}"
        )
    return mx.array(token_ids)


def _vocabulary_size(config: dict) -> int:
    for source in (config, config.get("text_config")):
        if not isinstance(source, dict):
            continue
        vocabulary = source.get("vocab_size")
        if isinstance(vocabulary, int) and vocabulary > 1:
            return vocabulary
    return FALLBACK_VOCABULARY


def build_parser() -> argparse.ArgumentParser:
    parser = command.tool_parser(
        "mlx-lm-check",
        "Greedy generation through mlx-lm with and without the mlx_dualnorm patch: "
        "identical token ids and bit-identical logits (exit 0), a divergence (exit 1), "
        "or bad arguments / an unloadable model (exit 2).",
    )
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument(
        "--model",
        metavar="PATH",
        help="local mlx-lm model folder (config.json, model*.safetensors); never downloaded",
    )
    source.add_argument(
        "--synthetic",
        choices=SYNTHETIC_MODEL_TYPES,
        metavar="NAME",
        help="a small random model of the mlx-lm family NAME, built here: "
        f"{', '.join(SYNTHETIC_MODEL_TYPES)}",
    )
    parser.add_argument(
        "--tokens", type=command.Count(1, MAX_TOKENS), default=64,
        help="greedy tokens to generate"
    )
    parser.add_argument(
        "--prompt",
        help="prompt text, encoded with the model folder's tokenizer (--model only; at most "
        f"{MAX_PROMPT_TOKENS} tokens); default: a fixed prompt of token ids",
    )
    parser.add_argument(
        "--prompt-tokens", type=command.Count(1, MAX_PROMPT_TOKENS), default=12,
        help="length of the fixed prompt",
    )
    parser.add_argument(
        "--rounds",
        type=command.Count(1, MAX_TIMING_ROUNDS),
        default=DEFAULT_TIMING_ROUNDS,
        help="timing rounds, each way once per round (the first is the compared one)",
    )
    command.add_mode_argument(parser)
    parser.add_argument(
        "--dtype", choices=tuple(DTYPES), help="--synthetic only: weight dtype (default per model)"
    )
    parser.add_argument(
        "--seed", type=command.seed, default=None,
        help=f"--synthetic only: weight seed, {DEFAULT_SEED} unless given",
    )
    command.add_device_argument(parser)
    return parser


def main(argv: Optional[Sequence[str]] = None) -> int:
    """``python -m mlx_dualnorm mlx-lm-check``; see the module doc."""
    return command.run_tool(build_parser(), _run, argv)


def _run(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    command.select_device(args.device, parser)
    try:
        # An unsupported mlx-lm, or a mode that cannot run here, is refused
        # before any model is built.
        with integration.patch(args.mode):
            pass
    except (RuntimeError, ValueError) as error:
        print(command.error_line("mlx-lm-check", str(error)), file=sys.stderr)
        return EXIT_USAGE
    try:
        if args.synthetic is not None:
            if args.prompt is not None:
                raise _UsageError("--prompt needs --model (synthetic models have no tokenizer)")
            model = build_synthetic_model(
                args.synthetic,
                seed=DEFAULT_SEED if args.seed is None else args.seed,
                dtype=DTYPES[args.dtype] if args.dtype else None,
            )
            model_name = f"synthetic {args.synthetic}"
            prompt = prompt_token_ids(
                _vocabulary_size(synthetic_model_config(args.synthetic)), args.prompt_tokens
            )
        else:
            for flag, value in (("--dtype", args.dtype), ("--seed", args.seed)):
                if value is not None:
                    raise _UsageError(f"{flag} is for --synthetic models only")
            model, config, path = _load_local_model(args.model)
            model_name = str(path)
            if args.prompt is not None:
                prompt = _encoded_prompt(path, args.prompt)
            else:
                prompt = prompt_token_ids(_vocabulary_size(config), args.prompt_tokens)
        refusal = cpu_refusal(model)
        if refusal is not None:
            raise _UsageError(f"{model_name} cannot run on this device: {refusal}")
    except (_UsageError, ValueError) as error:
        print(command.error_line("mlx-lm-check", str(error)), file=sys.stderr)
        return EXIT_USAGE

    progress = None
    if prompt.size >= LONG_PROMPT_TOKENS:
        runs = 2 + 2 * args.rounds  # two warm-ups, then each way once per round
        progress = command.StepProgress(f"mlx-lm-check, {prompt.size}-token prompt, runs", runs).step
    result = run_check(
        model, prompt, args.tokens, args.mode, timing_rounds=args.rounds, progress=progress
    )
    print(format_result(result, model_name, int(prompt.size)))
    return EXIT_IDENTICAL if result.comparison.identical else EXIT_DIVERGED


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
