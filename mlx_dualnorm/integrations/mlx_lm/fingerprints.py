"""Fingerprints of live code: what proves that a function is the code a
replacement was tested against.

A replacement restates some of mlx-lm's code (an attention class's
``__call__``, a norm's or a RoPE's ``__call__``, a cache's update). It may
run only where the function the program would run NOW, after any
monkeypatch, subclass override or newer release, is that code. So the
proof is taken from the live function object, never from a class's file:

* its source is read from its own code object (``co_filename`` and
  ``co_firstlineno``), never through ``__wrapped__``, so a wrapper made
  with ``functools.wraps`` is fingerprinted as the wrapper it is;
* that source, compiled again, must give the function's own bytecode,
  names and constants, so a file edited on disk after the import, or a
  function made by ``exec`` with another body, proves nothing;
* its globals must be the namespace of the module it names, so a copy of
  the text living elsewhere (with other names in scope) proves nothing;
* its default values must be the literals its source writes (a default
  assigned since, or one that is not a literal, proves nothing), and it
  may close over nothing but its class (``super()``'s ``__class__``);
* the fingerprint is 16 hex digits of the SHA-256 of its parsed source
  with docstrings dropped and positions left out (comments, blank lines
  and formatting do not count; every name, call, argument and constant
  does), spelled alike on every supported Python (:func:`stable_dump`).

A function with no readable source, or one that is not a plain Python
function, has no fingerprint and is never proven. This module imports
nothing of the integration: the recorded fingerprints live in the
registry, which asks here.
"""

from __future__ import annotations

import __future__
import ast
import hashlib
import inspect
import symtable
import sys
import textwrap
import types
from typing import Any, Optional

__all__ = ["function_fingerprint", "live_function", "stable_dump"]

# Every __future__ feature's compiler flag: a function's source is compiled
# again with the flags its own code was compiled with.
_FUTURE_FLAGS = 0
for _feature in __future__.all_feature_names:
    _FUTURE_FLAGS |= getattr(__future__, _feature).compiler_flag

# Code object fields that say what a function does (positions, names of
# the file and the function's qualname left out).
_CODE_FIELDS = (
    "co_code", "co_names", "co_varnames", "co_freevars", "co_cellvars",
    "co_argcount", "co_posonlyargcount", "co_kwonlyargcount",
)


def live_function(owner: type, attribute: str) -> object:
    """What ``owner`` resolves ``attribute`` to now (through its MRO, with
    any monkeypatch or subclass override), as stored: a plain function for
    a method; anything else (a property, a builtin, a missing attribute as
    None) is what it is and has no fingerprint."""
    for cls in owner.__mro__:
        if attribute in cls.__dict__:
            return cls.__dict__[attribute]
    return None


def function_fingerprint(function: object) -> Optional[str]:
    """The fingerprint of ``function``'s own code, or None where it has
    none (not a plain Python function, no readable source, a source that
    does not compile to the function's code, globals of another module)."""
    if type(function) is not types.FunctionType:
        return None
    code = function.__code__
    module = sys.modules.get(function.__module__ or "")
    if module is None or function.__globals__ is not getattr(module, "__dict__", None):
        return None
    try:
        lines, _ = inspect.getsourcelines(code)  # a code object has no __wrapped__
        source = textwrap.dedent("".join(lines))
        tree = ast.parse(source)
    except (OSError, TypeError, SyntaxError, IndentationError):
        return None
    if (
        len(tree.body) != 1
        or not isinstance(tree.body[0], (ast.FunctionDef, ast.AsyncFunctionDef))
        or tree.body[0].name != code.co_name
        or not _compiles_to(source, function)
        or not _defaults_are_the_source_s(tree.body[0], function)
        or not _closes_over_its_class_only(function)
    ):
        return None
    digest = hashlib.sha256(stable_dump(_without_docstrings(tree)).encode())
    return digest.hexdigest()[:16]


def _compiles_to(source: str, function: types.FunctionType) -> bool:
    """Whether ``source`` (a ``def``) compiles to ``function``'s code: a
    method inside a class of its class's name (for name mangling and
    ``super()``), a module function at module level."""
    qualname_parts = function.__qualname__.split(".")
    if "<locals>" in qualname_parts or len(qualname_parts) > 2:
        return False  # nested functions and classes: never recorded
    if len(qualname_parts) == 2:
        source = f"class {qualname_parts[0]}:\n" + textwrap.indent(source, "    ")
    imported = _imported_names(function.__module__)
    if imported is None:
        return False
    # The compiler calls an attribute of an imported name without
    # LOAD_METHOD: the module's imports are declared first (never run).
    source = "".join(f"import {name}\n" for name in imported) + source
    flags = function.__code__.co_flags & _FUTURE_FLAGS
    try:
        compiled = compile(source, "<fingerprint>", "exec", flags=flags, dont_inherit=True)
    except (SyntaxError, ValueError):
        return False
    if len(qualname_parts) == 2:
        compiled = _nested_code(compiled, qualname_parts[0])
    candidate = None if compiled is None else _nested_code(compiled, function.__code__.co_name)
    return candidate is not None and _same_code(candidate, function.__code__)


_imported_by_module: dict[str, Optional[tuple[str, ...]]] = {}


def _defaults_are_the_source_s(definition: ast.AST, function: types.FunctionType) -> bool:
    """Whether ``function.__defaults__`` and ``__kwdefaults__`` are the
    literal values its ``def`` writes, of the same types."""
    arguments = definition.args  # type: ignore[attr-defined]
    try:
        written = tuple(ast.literal_eval(node) for node in arguments.defaults)
        written_keywords = {
            argument.arg: ast.literal_eval(node)
            for argument, node in zip(arguments.kwonlyargs, arguments.kw_defaults)
            if node is not None
        }
    except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
        return False  # a default that is not a literal: its value is not in the source
    live = function.__defaults__ or ()
    live_keywords = function.__kwdefaults__ or {}
    return _same_values(written, live) and (
        written_keywords.keys() == live_keywords.keys()
        and _same_values(tuple(written_keywords.values()),
                         tuple(live_keywords[name] for name in written_keywords))
    )


def _same_values(a: tuple, b: tuple) -> bool:
    return len(a) == len(b) and all(
        type(x) is type(y) and repr(x) == repr(y) for x, y in zip(a, b)
    )


def _closes_over_its_class_only(function: types.FunctionType) -> bool:
    """No closure, or only the ``__class__`` cell of a method that calls
    ``super()``, holding a class of the method's own class name."""
    cells = function.__closure__ or ()
    names = function.__code__.co_freevars
    if not cells:
        return True
    if names != ("__class__",):
        return False
    try:
        owner = cells[0].cell_contents
    except ValueError:  # an empty cell
        return False
    return isinstance(owner, type) and function.__qualname__.split(".")[0] == owner.__qualname__


def _imported_names(module_name: str) -> Optional[tuple[str, ...]]:
    """The names the module's top level binds by ``import``, read from its
    source (None where it cannot be read)."""
    if module_name not in _imported_by_module:
        try:
            table = symtable.symtable(
                inspect.getsource(sys.modules[module_name]), module_name, "exec"
            )
            names: Optional[tuple[str, ...]] = tuple(
                sorted(symbol.get_name() for symbol in table.get_symbols() if symbol.is_imported())
            )
        except (KeyError, OSError, TypeError, SyntaxError):
            names = None
        _imported_by_module[module_name] = names
    return _imported_by_module[module_name]


def _nested_code(code: types.CodeType, name: str) -> Optional[types.CodeType]:
    for constant in code.co_consts:
        if isinstance(constant, types.CodeType) and constant.co_name == name:
            return constant
    return None


def _same_code(a: types.CodeType, b: types.CodeType) -> bool:
    if any(getattr(a, field) != getattr(b, field) for field in _CODE_FIELDS):
        return False
    if getattr(a, "co_exceptiontable", b"") != getattr(b, "co_exceptiontable", b""):
        return False
    if len(a.co_consts) != len(b.co_consts):
        return False
    for x, y in zip(a.co_consts, b.co_consts):
        if isinstance(x, types.CodeType) or isinstance(y, types.CodeType):
            if not (isinstance(x, types.CodeType) and isinstance(y, types.CodeType)):
                return False
            if not _same_code(x, y):
                return False
        elif type(x) is not type(y) or repr(x) != repr(y):  # 0.0 vs -0.0, 1 vs True
            return False
    return True


def _without_docstrings(tree: ast.AST) -> ast.AST:
    for node in ast.walk(tree):
        if isinstance(node, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            body = node.body
            if (
                body
                and isinstance(body[0], ast.Expr)
                and isinstance(body[0].value, ast.Constant)
                and isinstance(body[0].value.value, str)
            ):
                node.body = body[1:] or [ast.Pass()]
    return tree


def stable_dump(node: Any) -> str:
    """A parsed tree as text that every supported Python spells alike.

    ``ast.dump`` does not: Python 3.12 adds ``type_params=[]`` to every
    class and function, and 3.13 leaves out fields that are None or empty.
    Here a field that is None or an empty list is always left out (its
    absence says the same), every other one written as ``name=value``, and
    positions never; an f-string's empty text pieces are left out too (3.12
    parses ``f"{x:>{w}}"``'s format spec with a trailing ``''``, 3.11 and
    3.13 without). So the same source gives the same text, and the same
    fingerprint, on each of them."""
    if isinstance(node, ast.AST):
        fields = []
        for name in node._fields:
            value = getattr(node, name, None)
            if isinstance(node, ast.JoinedStr) and name == "values" and value:
                value = [piece for piece in value
                         if not (isinstance(piece, ast.Constant) and piece.value == "")]
            if value is None or (isinstance(value, list) and not value):
                continue
            fields.append(f"{name}={stable_dump(value)}")
        return f"{type(node).__name__}({', '.join(fields)})"
    if isinstance(node, list):
        return f"[{', '.join(stable_dump(item) for item in node)}]"
    return repr(node)
