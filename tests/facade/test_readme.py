"""Every code block of README.md runs as written.

Python blocks run in a fresh interpreter each (one may patch mlx-lm for the
rest of its process). Shell blocks are the package's commands: each runs
with this interpreter standing for the README's ``python``. The set-up block
makes a virtual environment and installs into it, minutes of network and
compiling: here its form is checked (the extras it names exist and give
every feature) and its Python part runs, except ``pytest`` itself (this is
that run); .ci/run executes the set-up block's test command verbatim in a
fresh clone. A block that needs a GPU or a local model is marked in the
README with ``<!-- readme-test: skip, REASON -->`` and reported skipped with
that reason.
"""

from __future__ import annotations

import pathlib
import re
import shlex
import subprocess
import sys
from typing import NamedTuple

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
SKIP_MARK = re.compile(r"<!--\s*readme-test:\s*skip,\s*(?P<reason>.*?)\s*-->")
FENCE = re.compile(r"^```(?P<language>\w*)\s*$")
SETUP_LINE = re.compile(
    r'^python3 -m venv \.venv && \.venv/bin/pip install -e "\.\[(?P<extras>[\w,-]+)\]"'
    r" && \.venv/bin/python -m (?P<module_command>.+)$"
)
# Extras that choose one MLX backend; the CPU set-up takes the cpu one.
BACKEND_EXTRAS = {"cpu", "cuda13"}


class CodeBlock(NamedTuple):
    language: str
    first_line: int
    text: str
    skip_reason: str | None


def readme_blocks() -> list[CodeBlock]:
    blocks = []
    lines = README.read_text().splitlines()
    index = 0
    while index < len(lines):
        opening = FENCE.match(lines[index])
        if not opening:
            index += 1
            continue
        closing = index + 1
        while not lines[closing].startswith("```"):
            closing += 1
        previous = next((line for line in reversed(lines[:index]) if line.strip()), "")
        mark = SKIP_MARK.search(previous)
        blocks.append(
            CodeBlock(
                opening["language"],
                index + 1,
                "\n".join(lines[index + 1 : closing]),
                mark["reason"] if mark else None,
            )
        )
        index = closing + 1
    return blocks


RUNNABLE = [block for block in readme_blocks() if block.language in ("python", "bash")]


def _skip_if_marked(block: CodeBlock) -> None:
    if block.skip_reason:
        pytest.skip(f"README.md line {block.first_line}: {block.skip_reason}")


def _run(arguments: list[str], cwd: pathlib.Path) -> None:
    process = subprocess.run(arguments, cwd=cwd, capture_output=True, text=True, timeout=600)
    assert process.returncode == 0, (
        f"{arguments} exited {process.returncode}\n{process.stdout[-3000:]}\n{process.stderr[-3000:]}"
    )


def test_readme_has_the_blocks_it_promises() -> None:
    languages = [block.language for block in RUNNABLE]
    assert languages.count("python") >= 2 and languages.count("bash") >= 3, languages
    assert any(SETUP_LINE.match(line) for block in RUNNABLE for line in block.text.splitlines())


def each_runnable_block(language: str):
    """Parametrizes a test over the README's runnable blocks of ``language``,
    each named by the line it starts on."""
    return pytest.mark.parametrize(
        "block",
        [block for block in RUNNABLE if block.language == language],
        ids=lambda block: f"{language}-line-{block.first_line}",
    )


@each_runnable_block("python")
def test_python_block_runs(block: CodeBlock, tmp_path: pathlib.Path) -> None:
    _skip_if_marked(block)
    _run([sys.executable, "-c", block.text], tmp_path)


def _declared_extras() -> set[str]:
    tomllib = pytest.importorskip("tomllib", reason="reading pyproject.toml needs Python 3.11")
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    return set(project["optional-dependencies"])


def _check_setup_line(line: str, tmp_path: pathlib.Path) -> None:
    match = SETUP_LINE.match(line)
    assert match, f"a set-up line of an unknown form: {line}"
    extras = set(match["extras"].split(","))
    declared = _declared_extras()
    assert extras <= declared, extras - declared
    backends = extras & BACKEND_EXTRAS
    assert len(backends) == 1, f"one MLX backend per set-up line: {line}"
    missing_features = declared - BACKEND_EXTRAS - extras
    assert not missing_features, f"{line} leaves out the extras {sorted(missing_features)}"
    module_command = shlex.split(match["module_command"])
    if module_command[0] == "pytest":
        return  # this suite is that command's run; .ci/run runs the line itself
    _run([sys.executable, "-m", *module_command], tmp_path)


@each_runnable_block("bash")
def test_shell_block_runs(block: CodeBlock, tmp_path: pathlib.Path) -> None:
    _skip_if_marked(block)
    for line in block.text.splitlines():
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        if line.startswith("python3 -m venv"):
            _check_setup_line(line, tmp_path)
            continue
        words = shlex.split(line, comments=True)
        assert words[:2] == ["python", "-m"], f"a README command of an unknown form: {line}"
        _run([sys.executable, *words[1:]], tmp_path)


def _build_backend():
    """build_backend.py, the module that makes the package's long
    description (it imports setuptools' backend)."""
    import importlib.util

    pytest.importorskip("setuptools", reason="build_backend.py imports setuptools' backend")
    spec = importlib.util.spec_from_file_location("mlx_dualnorm_build_backend", ROOT / "build_backend.py")
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


LINK_TARGET = re.compile(r"\]\(([^)\s]+)")


def _targets_outside_code(text: str) -> list[str]:
    targets, in_code = [], False
    for line in text.splitlines():
        if line.lstrip().startswith("```"):
            in_code = not in_code
        elif not in_code:
            targets.extend(LINK_TARGET.findall(line))
    return targets


def test_the_readme_links_resolve_here() -> None:
    targets = [target for target in _targets_outside_code(README.read_text()) if "://" not in target]
    assert targets
    headings = {
        re.sub(r"[^\w\- ]", "", line.lstrip("#").strip().lower()).replace(" ", "-")
        for line in README.read_text().splitlines()
        if line.startswith("#")
    }
    for target in targets:
        path, _, anchor = target.partition("#")
        if path:
            assert (ROOT / path).exists(), f"README.md links to {target}, which is not in the repository"
        else:
            assert anchor in headings, f"README.md links to {target}, which names no heading"


def test_the_long_description_is_the_readme_with_absolute_links() -> None:
    backend = _build_backend()
    description = backend.long_description(README)
    readme_targets = _targets_outside_code(README.read_text())
    targets = _targets_outside_code(description)
    assert len(targets) == len(readme_targets) > 0
    base = backend.PROJECT_URL
    for relative, absolute in zip(readme_targets, targets):
        if "://" in relative:
            assert absolute == relative
            continue
        assert absolute.startswith(f"{base}/blob/main/") or absolute.startswith(f"{base}/tree/main/"), absolute
        path = relative.partition("#")[0] or "README.md"
        assert absolute.split("/main/", 1)[1].partition("#")[0] == path
    # Code blocks are the README's own, character for character.
    assert [line for line in description.splitlines() if "](" not in line] == [
        line for line in README.read_text().splitlines() if "](" not in line
    ]
    tomllib = pytest.importorskip("tomllib", reason="reading pyproject.toml needs Python 3.11")
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert project["urls"]["Homepage"] == base
    assert "readme" in project["dynamic"]
