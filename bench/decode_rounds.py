"""What the mlx-lm decode experiments (cache_write.py, decode_ceiling.py)
share: their command line, the model at released dimensions, and rounds
that run every path in turn."""

from __future__ import annotations

import argparse
from typing import Callable, Sequence, TypeVar

from mlx_dualnorm.commands.mlx_lm_bench import DECODE_DTYPE_OF_WEIGHTS, DECODE_PROMPT_TOKENS
from mlx_dualnorm.commands.shared.synthetic import build_model, prompt_token_ids

Measured = TypeVar("Measured")


def decode_parser(doc: str, rounds: int) -> argparse.ArgumentParser:
    """The options every decode experiment takes; ``doc``'s first paragraph
    is the description."""
    parser = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    parser.add_argument("--model", default="qwen3-1024", help="qwen3-1024 or qwen3-2048")
    parser.add_argument("--rounds", type=int, default=rounds)
    parser.add_argument("--steps", type=int, default=64)
    parser.add_argument("--layers", type=int, help="fewer layers (a dry run on CPU)")
    return parser


def network_and_prompt(config: dict):
    """The model of ``config`` with the decode benchmark's weights, and its prompt."""
    network = build_model(config, dtype=DECODE_DTYPE_OF_WEIGHTS)
    return network, prompt_token_ids(config["vocab_size"], DECODE_PROMPT_TOKENS)


def round_robin(
    paths: Sequence[str], rounds: int, measure: Callable[[str], Measured]
) -> dict[str, list[Measured]]:
    """``measure(path)`` for every path, ``rounds`` times, the order
    reversed every other round so neither end always runs warm."""
    results: dict[str, list[Measured]] = {path: [] for path in paths}
    for round_index in range(rounds):
        for path in paths if round_index % 2 == 0 else paths[::-1]:
            results[path].append(measure(path))
    return results
