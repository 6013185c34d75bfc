"""``python -m mlx_dualnorm mlx-lm-check``: greedy generation through mlx-lm
unpatched, then patched, compared token for token and logit bit for bit, on a
LOCAL model folder (never downloaded) or a small random model. Exit status: 0
identical, 1 diverged, 2 bad arguments or an unloadable model."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Optional, Sequence

import mlx.core as mx
import mlx.nn as nn

from mlx_dualnorm.commands.mlx_lm_check.check import (
    DEFAULT_TIMING_ROUNDS, format_result, run_check,
)
from mlx_dualnorm.commands.shared import command
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
LONG_PROMPT_TOKENS = 256  # from here on, each generation run is a progress line on stderr
TOKENIZER_FILES = (  # a Hugging Face tokenizer's files, one of which --prompt needs
    "tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json", "vocab.txt",
    "spiece.model",
)


class _UsageError(command.Unavailable):
    """Bad arguments or an unloadable model: one line from run_tool, exit 2."""


def _load_local_model(path_text: str) -> tuple[nn.Module, dict, Path]:
    """mlx_lm.utils.load_model on an existing folder; never downloads. A
    failure is a usage error naming the folder and the cause."""
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


def _encoded_prompt(folder: Path, text: str) -> mx.array:
    """``--prompt``, encoded with the folder's own tokenizer."""
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


def _fixed_prompt(config: dict, length: int) -> mx.array:
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
    return command.run_tool(build_parser(), _run, argv)


def _run(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    command.select_device(args.device, parser)
    try:
        # An unsupported mlx-lm, or a mode that cannot run here, is refused
        # before any model is built.
        with integration.patch(args.mode):
            pass
    except (RuntimeError, ValueError) as error:
        raise _UsageError(str(error)) from None
    try:
        if args.synthetic is not None:
            if args.prompt is not None:
                raise _UsageError("--prompt needs --model (synthetic models have no tokenizer)")
            model = build_synthetic_model(
                args.synthetic, seed=DEFAULT_SEED if args.seed is None else args.seed,
                dtype=DTYPES[args.dtype] if args.dtype else None,
            )
            model_name = f"synthetic {args.synthetic}"
            prompt = _fixed_prompt(synthetic_model_config(args.synthetic), args.prompt_tokens)
        else:
            for flag, value in (("--dtype", args.dtype), ("--seed", args.seed)):
                if value is not None:
                    raise _UsageError(f"{flag} is for --synthetic models only")
            model, config, path = _load_local_model(args.model)
            model_name = str(path)
            if args.prompt is not None:
                prompt = _encoded_prompt(path, args.prompt)
            else:
                prompt = _fixed_prompt(config, args.prompt_tokens)
        refusal = cpu_refusal(model)
        if refusal is not None:
            raise _UsageError(f"{model_name} cannot run on this device: {refusal}")
    except ValueError as error:
        raise _UsageError(str(error)) from None
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
