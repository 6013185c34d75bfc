"""docs/cli.md against the command line itself: every list of choices it
gives is the parser's own (argparse ``choices``, or the names a
comma-separated option accepts), every option with choices is listed
there, and its numbers (matrix sizes, the prompt and seed bounds) are the
code's. A family, path or model added to the code fails here until the
page lists it."""

from __future__ import annotations

import importlib.util
import pathlib
import re

import pytest

from mlx_dualnorm.commands import cli

from mlx_dualnorm.commands.shared import command

from mlx_dualnorm.commands.parity import matrices
from mlx_dualnorm.commands.shared.paths import PATH_REGISTRY

DOCS = pathlib.Path(__file__).resolve().parents[2] / "docs"
CLI_PAGE = DOCS / "cli.md"
pytestmark = pytest.mark.skipif(not CLI_PAGE.is_file(), reason="not a source tree")

HAS_MLX_LM = importlib.util.find_spec("mlx_lm") is not None
SUBCOMMANDS = [
    subcommand.name for subcommand in cli.SUBCOMMANDS
    if HAS_MLX_LM or not subcommand.name.startswith("mlx-lm")
]
CHOICES = re.compile(r"<!-- choices: (?P<key>[^>]*?) -->(?P<items>.*?)<!-- /choices -->", re.DOTALL)


def documented_choices() -> dict[str, list[str]]:
    """``"SUB-COMMAND --option"`` (or ``"--device"``, the global option) ->
    the backticked names between its markers, in the page's order."""
    text = CLI_PAGE.read_text(encoding="utf-8")
    found: dict[str, list[str]] = {}
    for match in CHOICES.finditer(text):
        key = " ".join(match["key"].split())
        assert key not in found, f"{key} is listed twice"
        found[key] = re.findall(r"`([^`]+)`", match["items"])
    return found


def comma_list_names() -> dict[str, list[str]]:
    """The comma-separated options, which check their names themselves."""
    names = {"bench --paths": list(PATH_REGISTRY)}
    if HAS_MLX_LM:
        from mlx_dualnorm.commands.shared.synthetic import DECODE_MODELS

        names["mlx-lm-bench --decode-models"] = list(DECODE_MODELS)
    return names


def parser_choices() -> dict[str, list[str]]:
    """Every option with choices of every sub-command; ``--device`` once,
    the same for all (asserted)."""
    found: dict[str, list[str]] = {"--device": list(command.DEVICE_CHOICES)}
    for name in SUBCOMMANDS:
        for action in cli.subcommand_parser(name)._actions:  # argparse lists no actions publicly
            if not action.choices:
                continue
            (option,) = [flag for flag in action.option_strings if flag.startswith("--")]
            if option == "--device":
                assert list(action.choices) == found["--device"], name
                continue
            found[f"{name} {option}"] = list(action.choices)
    found.update(comma_list_names())
    return found


def test_every_list_of_choices_is_the_command_lines_own():
    actual = parser_choices()
    documented = {
        key: names for key, names in documented_choices().items()
        if HAS_MLX_LM or not key.startswith("mlx-lm")  # those parsers need mlx-lm
    }
    assert sorted(documented) == sorted(actual), "docs/cli.md lists other options' choices"
    for key, names in actual.items():
        assert documented[key] == names, f"docs/cli.md's choices of {key}"


def test_the_main_usage_line_lists_the_device_choices():
    text = CLI_PAGE.read_text(encoding="utf-8")
    assert f"[--device {{{','.join(command.DEVICE_CHOICES)}}}]" in text


def test_the_parity_numbers_are_the_matrices():
    text = " ".join(CLI_PAGE.read_text(encoding="utf-8").split())
    full = matrices.build_full_parity_matrix()
    families = {case.family for case in full}
    assert f"({len(full)} cases in {len(families)} families" in text
    rope_matrix = matrices.build_rope_parity_matrix()
    assert f"the norm + RoPE matrix of {len(rope_matrix)} cases: the `norm_rope` family" in text
    assert {case.family for case in rope_matrix} == {"norm_rope", "rope_only"}
    quick = len(matrices.build_quick_parity_matrix())
    quick_rope = len(matrices.build_rope_parity_matrix(quick=True))
    assert f"a small matrix ({quick} dual norm cases and {quick_rope} norm + RoPE cases)" in text
    help_text = " ".join(cli.subcommand_parser("parity").format_help().split())
    assert f"({quick} dual norm cases and {quick_rope} norm + RoPE cases)" in help_text


def test_the_bounds_are_the_code_s():
    text = " ".join(CLI_PAGE.read_text(encoding="utf-8").split())
    assert f"from 0 to {command.SEED_MAX} (2**32 - 1)" in text
    if HAS_MLX_LM:
        from mlx_dualnorm.commands import mlx_lm_check

        assert f"either prompt is at most {mlx_lm_check.MAX_PROMPT_TOKENS} tokens" in text
        assert f"From {mlx_lm_check.LONG_PROMPT_TOKENS} prompt tokens on" in text


@pytest.mark.skipif(not HAS_MLX_LM, reason="needs mlx-lm")
def test_the_synthetic_help_names_no_head_widths_it_does_not_have():
    """Its help once said "real gated-delta head widths" of every model,
    olmo2 and gemma3_text included: it names the models instead."""
    help_text = " ".join(cli.subcommand_parser("mlx-lm-check").format_help().split())
    assert "gated-delta head widths" not in help_text
    assert "olmo2" in help_text and "qwen3_moe" in help_text


def test_the_c_library_page_says_which_python_builds_and_how_to_choose():
    text = " ".join((DOCS / "c-library.md").read_text(encoding="utf-8").split())
    assert "PYTHON=.venv/bin/python scripts/build_subset_mlx_c.sh" in text
    assert "`python3` on `PATH` unless `PYTHON` names another" in text
