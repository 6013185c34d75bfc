"""Every numeric option of every command has a range, checked before any
work, shown in its help and listed in docs/cli.md: the parsers are walked
(their actions), so an option added without a bound fails here.

A count without a maximum once let ``bench --layers 100000000`` grow to
24 GB, and ``mlx-lm-check --rounds 100000000`` run for ever."""

from __future__ import annotations

import argparse
import functools
import importlib.util
import pathlib
import re

import pytest

from mlx_dualnorm.commands import cli

from mlx_dualnorm.commands.shared import command

HAS_MLX_LM = importlib.util.find_spec("mlx_lm") is not None
CLI_PAGE = pathlib.Path(__file__).resolve().parents[2] / "docs" / "cli.md"
SUBCOMMANDS = [
    subcommand.name for subcommand in cli.SUBCOMMANDS
    if HAS_MLX_LM or not subcommand.name.startswith("mlx-lm")
]
BOUNDED_TYPES = (command.Count, command.Number)


def _walk(name: str, parser: argparse.ArgumentParser):
    """(command name, action) of ``parser`` and of every parser below it."""
    for action in parser._actions:  # argparse lists no actions publicly
        if isinstance(action, argparse._SubParsersAction):
            for sub_name, sub_parser in action.choices.items():
                yield from _walk(f"{name} {sub_name}".strip(), sub_parser)
        else:
            yield name, action


# bench/'s scripts that share the commands' argument types, by the operation their errors name.
BENCH_SCRIPTS = {
    "tensor_parallel_decode": "tensor_parallel_decode.py", "mlx_lm_prework": "mlx_lm_prework.py",
}
BENCH_DIR = pathlib.Path(__file__).resolve().parents[2] / "bench"


def script_parser(operation: str) -> argparse.ArgumentParser:
    """The parser of one of bench/'s scripts, loaded from its file."""
    path = BENCH_DIR / BENCH_SCRIPTS[operation]
    spec = importlib.util.spec_from_file_location(f"bench_{operation}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.build_parser()


def every_parser() -> dict[str, argparse.ArgumentParser]:
    parsers = {"": cli._main_parser()}
    for name in SUBCOMMANDS:
        parsers[name] = cli.subcommand_parser(name)
    if HAS_MLX_LM and BENCH_DIR.is_dir():
        parsers.update({operation: script_parser(operation) for operation in BENCH_SCRIPTS})
    return parsers


def _is_numeric(action: argparse.Action) -> bool:
    if isinstance(action.type, BOUNDED_TYPES) or action.type in (int, float):
        return True
    default = action.default
    return isinstance(default, (int, float)) and not isinstance(default, bool)


def numeric_options() -> list[tuple[str, str, argparse.Action]]:
    found = []
    for parser_name, parser in every_parser().items():
        for name, action in _walk(parser_name, parser):
            if action.option_strings and action.nargs != 0 and _is_numeric(action):
                found.append((name, action.option_strings[-1], action))
    return found


def test_the_walk_finds_the_numeric_options():
    """The walk is not empty by accident: the counts known to exist are found."""
    found = {(name, option) for name, option, _ in numeric_options()}
    assert {("bench", "--layers"), ("replay", "--steps"), ("parity", "--seed")} <= found
    if HAS_MLX_LM:
        assert {("mlx-lm-check", "--tokens"), ("mlx-lm-check", "--rounds"),
                ("mlx-lm-bench", "--decode-rounds"), ("mlx-lm-bench", "--decode-steps"),
                ("tensor_parallel_decode", "--ranks"),
                ("tensor_parallel_decode rank", "--steps")} <= found


def test_every_numeric_option_has_a_bounded_type():
    unbounded = [
        f"{name} {option}" for name, option, action in numeric_options()
        if not isinstance(action.type, BOUNDED_TYPES)
    ]
    assert unbounded == [], "numeric options without a range"


def test_every_bounded_option_shows_its_range_in_its_help():
    for parser_name in SUBCOMMANDS:
        help_text = " ".join(cli.subcommand_parser(parser_name).format_help().split())
        for name, option, action in numeric_options():
            if name == parser_name:
                assert re.search(rf"\({re.escape(action.type.range_text)}[;)]", help_text), \
                    f"{name} {option}"


def documented_ranges() -> dict[tuple[str, str], str]:
    text = CLI_PAGE.read_text(encoding="utf-8")
    (table,) = re.findall(r"<!-- ranges -->(.*?)<!-- /ranges -->", text, re.DOTALL)
    rows = re.findall(r"^\| `([^`]+)` \| `([^`]+)` \| ([^|]+?) \|$", table, re.MULTILINE)
    return {(name, option): bounds for name, option, bounds in rows}


@pytest.mark.skipif(not CLI_PAGE.is_file(), reason="not a source tree")
def test_docs_list_every_range_as_the_code_has_it():
    actual = {
        (name, option): action.type.range_text
        for name, option, action in numeric_options()
        if name in SUBCOMMANDS
    }
    documented = {
        key: bounds for key, bounds in documented_ranges().items()
        if HAS_MLX_LM or not key[0].startswith("mlx-lm")
    }
    assert documented == actual


# ---- The bounds hold before any work --------------------------------------------


def _refused(main, arguments, capsys) -> str:
    assert main(arguments) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err.count("\n") == 1, captured
    return captured.err


@pytest.mark.parametrize(
    "subcommand, arguments, message",
    [
        ("bench", ["--quick", "--layers", "100000000"], "--layers: must be at most 512"),
        ("bench", ["--quick", "--repeats", "1000000"], "--repeats: must be at most 1000"),
        ("bench", ["--quick", "--eps", "1e30"], "--eps: must be finite, from 0 to 1"),
        ("replay", ["--steps", "1000000000000"], "--steps: must be at most 4096"),
        ("mlx-lm-check", ["--synthetic", "qwen3", "--tokens", "1000000000000"],
         "--tokens: must be at most 1024"),
        ("mlx-lm-check", ["--synthetic", "qwen3", "--rounds", "100000000"],
         "--rounds: must be at most 100"),
        ("mlx-lm-bench", ["--decode-steps", "100000000"], "--decode-steps: must be at most 1024"),
        ("mlx-lm-bench", ["--decode-rounds", "1000"], "--decode-rounds: must be at most 100"),
    ],
)
def test_a_count_past_its_maximum_is_refused_before_any_work(subcommand, arguments, message,
                                                              capsys):
    if subcommand.startswith("mlx-lm"):
        pytest.importorskip("mlx_lm")
    error = _refused(cli.main, [subcommand, *arguments], capsys)
    assert f"[{subcommand}] argument {message}" in error


def _bad_values(bounded) -> list[str]:
    """Values every option of this range must refuse: not a number, empty,
    just outside each end, and (for an integer) a fraction."""
    values = ["abc", "", f"{bounded.minimum - 1}", "nan", "inf"]
    if isinstance(bounded, command.Count):
        values += [f"{bounded.maximum + 1}", "1.5"]
    else:
        values += [f"{bounded.maximum * 2 + 1}"]
    return values


def _each_bad_value():
    for name, option, action in numeric_options():
        if name in SUBCOMMANDS or name in BENCH_SCRIPTS:
            for value in _bad_values(action.type):
                yield pytest.param(name, option, value, id=f"{name} {option}={value!r}")


def _run_parser(name: str, arguments: list[str]) -> int:
    """The command (or script) ``name`` on ``arguments``, stopped once they are read."""
    if name in SUBCOMMANDS:
        return cli.main([name, *arguments])
    return command.run_tool(script_parser(name), lambda *read: command.EXIT_OK, arguments)


@pytest.mark.parametrize("subcommand, option, value", list(_each_bad_value()))
def test_every_numeric_option_refuses_bad_values_in_one_line(subcommand, option, value, capsys):
    """Driven from the parsers: an option added later is covered too."""
    error = _refused(functools.partial(_run_parser, subcommand), [f"{option}={value}"], capsys)
    assert error.startswith(f"[{subcommand}] argument {option}: "), error


@pytest.mark.parametrize(
    "arguments, message",
    [
        (["bench", "--paths", "compiled,,composed"], "--paths: an empty name"),
        (["mlx-lm-bench", "--decode-models", "qwen3-1024,,llama-2048"],
         "--decode-models: an empty name"),
    ],
)
def test_an_empty_name_in_a_list_is_refused(arguments, message, capsys):
    if arguments[0].startswith("mlx-lm"):
        pytest.importorskip("mlx_lm")
    assert message in _refused(cli.main, arguments, capsys)


def test_a_name_repeated_in_a_list_is_measured_once():
    """A list of names cannot make a run longer than all of them once."""
    pytest.importorskip("mlx_lm")
    from mlx_dualnorm.commands import bench as benchmark, mlx_lm_bench, replay
    from mlx_dualnorm.commands.shared import paths as compared_paths

    names = command.name_list("--decode-models", ",".join(["qwen3-1024"] * 1000),
                              mlx_lm_bench.DECODE_MODELS)
    assert names == ["qwen3-1024"]
    parser = benchmark.build_parser()
    arguments = parser.parse_args(["--paths", "compiled,compiled,composed"])
    config = benchmark._config_from_arguments(arguments, parser)
    assert config.paths == ("compiled", "composed")
    selection = compared_paths.PathSelection.of(None, replay.PATH_FACTORIES)
    arguments = argparse.Namespace(path_names=["compiled"] * 1000)
    assert selection.named(arguments) == ["compiled"]
