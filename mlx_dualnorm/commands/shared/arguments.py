"""The argument types every command's numbers and output paths are read
with: each value is checked where argparse reads it, the same way for every
command, before any work. Every number is a :class:`Count` or
:class:`Number` (or a :class:`CountList` of counts) with a range that its
help shows (``range_text``); every output path is tried for real."""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import math
import pathlib
import tempfile

__all__ = ["Count", "CountList", "Number", "SEED_MAX", "output_file", "output_folder", "seed"]


def _integer(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None


@dataclasses.dataclass(frozen=True)
class Count:
    """argparse ``type`` of an integer option from ``minimum`` to
    ``maximum``: every integer option of every command is one, so each has
    a range, checked where argparse reads it (a bad value is a usage error
    naming the option, exit 2, before any work) and shown in its help
    (``range_text``). The maximum bounds what the option can make a
    command hold in memory or run for."""

    minimum: int
    maximum: int

    @property
    def range_text(self) -> str:
        return f"{self.minimum} to {self.maximum}"

    def __call__(self, text: str) -> int:
        value = _integer(text)
        if self.minimum <= value <= self.maximum:
            return value
        if self.minimum == 1:  # a count: "at least 1" / "at most N" reads best
            bound = "at least 1" if value < 1 else f"at most {self.maximum}"
        else:
            bound = f"from {self.minimum} to {self.maximum}"
        raise argparse.ArgumentTypeError(f"must be {bound}, got {value}")


@dataclasses.dataclass(frozen=True)
class Number:
    """argparse ``type`` of a finite number from ``minimum`` to
    ``maximum`` (an epsilon); its help shows the range."""

    minimum: float
    maximum: float

    @property
    def range_text(self) -> str:
        return f"{self.minimum:g} to {self.maximum:g}"

    def __call__(self, text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
        if not (math.isfinite(value) and self.minimum <= value <= self.maximum):
            raise argparse.ArgumentTypeError(
                f"must be finite, from {self.minimum:g} to {self.maximum:g}, got {text}"
            )
        return value


@dataclasses.dataclass(frozen=True)
class CountList:
    """argparse ``type`` of comma-separated integers, each in ``item``'s
    range, at most ``max_items`` of them; an empty string is an empty list
    (measure none), an empty item between commas (``36,,48``) is refused."""

    item: Count
    max_items: int

    @property
    def range_text(self) -> str:
        return f"up to {self.max_items} values, each {self.item.range_text}"

    def __call__(self, text: str) -> list[int]:
        if not text.strip():
            return []
        parts = [part.strip() for part in text.split(",")]
        if not all(parts):
            raise argparse.ArgumentTypeError(f"an empty value in {text!r}")
        if len(parts) > self.max_items:
            raise argparse.ArgumentTypeError(
                f"at most {self.max_items} values, got {len(parts)}"
            )
        return [self.item(part) for part in parts]


# Every tool's seed is an integer in numpy's seed range: MLX keys take 64
# bits, but parity's case keys use the seed's low 32 bits, so a wider seed
# would repeat another's values.
SEED_MAX = 2**32 - 1
seed = Count(0, SEED_MAX)
"""argparse ``type`` of ``--seed``, the same for every command: an
integer from 0 to ``SEED_MAX`` (2**32 - 1)."""


def _refusal(text: str, failed: OSError) -> argparse.ArgumentTypeError:
    return argparse.ArgumentTypeError(f"cannot write {text}: {failed.strerror or failed}")


def _try_writing_into(folder: pathlib.Path, text: str) -> None:
    """Creates and removes a file in ``folder``: permission bits say
    nothing for root, nor for a read-only mount or a /proc folder; this
    asks the file system itself."""
    try:
        with tempfile.NamedTemporaryFile(dir=folder, prefix=".mlx_dualnorm-write-check-"):
            pass
    except OSError as failed:
        raise _refusal(text, failed) from None


def _path(text: str) -> pathlib.Path:
    """The path an output option names: not empty (an empty name would be
    the current folder), ``~`` expanded."""
    if not text.strip():
        raise argparse.ArgumentTypeError("an empty path; give a path")
    try:
        return pathlib.Path(text).expanduser()
    except RuntimeError as no_home:  # "~nouser/x"
        raise argparse.ArgumentTypeError(f"cannot write {text}: {no_home}") from None


def output_folder(text: str) -> pathlib.Path:
    """argparse ``type`` of a folder a command writes files into, tried
    for real when the arguments are read, so a bad path stops the command
    before it measures anything: a folder missing is created (with its
    missing parents) and a file created and removed in it, then what was
    created is removed again; the command creates it for good when it
    writes."""
    try:
        return _output_folder(text)
    except OSError as failed:  # a name too long, a loop of links, ...
        raise _refusal(text, failed) from None


def output_file(text: str) -> pathlib.Path:
    """argparse ``type`` of a file a command writes, in an existing folder
    (none is created), tried for real when the arguments are read, before
    any work: an existing file is opened for appending (nothing written),
    a new one created and removed."""
    try:
        return _output_file(text)
    except OSError as failed:
        raise _refusal(text, failed) from None


def _output_folder(text: str) -> pathlib.Path:
    path = _path(text)
    if path.exists():
        if not path.is_dir():
            raise argparse.ArgumentTypeError(f"{text} exists and is not a folder")
        _try_writing_into(path, text)
        return path
    created = []
    folder = path.absolute()
    while not folder.exists():
        created.append(folder)
        folder = folder.parent
    if not folder.is_dir():
        raise argparse.ArgumentTypeError(f"cannot create {text}: {folder} is not a folder")
    try:
        for missing in reversed(created):
            missing.mkdir()
        _try_writing_into(path, text)
    except OSError as failed:
        raise _refusal(text, failed) from None
    finally:
        for made in created:  # deepest first
            with contextlib.suppress(OSError):
                made.rmdir()
    return path


def _output_file(text: str) -> pathlib.Path:
    path = _path(text)
    if path.is_dir():
        raise argparse.ArgumentTypeError(f"{text} is a folder; give the path of a file")
    folder = path.absolute().parent
    if not folder.is_dir():
        raise argparse.ArgumentTypeError(f"no folder {folder} to write {path.name} into")
    try:
        if path.exists():
            with open(path, "a"):
                pass
        else:
            with open(path, "x"):
                pass
            path.unlink()
    except OSError as failed:
        raise _refusal(text, failed) from None
    return path
