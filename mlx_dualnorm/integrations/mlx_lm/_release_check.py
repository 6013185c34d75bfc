"""Which attention classes an mlx-lm release lets the patch engage.

The full-attention replacements are written against, and tested bit for
bit on, the mlx-lm release line that has ``gated_delta.normalize_qk``
(0.32.x). On such a release every registered class is patched, as its
code is the code the replacements reproduce.

On a release without it (0.31.x) there is no gated-delta fold, and an
attention class is patched only where its code is PROVEN to be the code a
replacement reproduces: the class's source, parsed, with docstrings
dropped and positions ignored (so comments, blank lines and formatting do
not count, every name, call, argument and constant does), must hash to a
fingerprint recorded here from the tested release. The replacement runs
the class's own projections, norms, RoPE and attention functions (looked
up in the class's own module, as its code does), so identical class code
means identical calls in the same order, whatever else the release
changed; a class whose code differs in any way, or whose source cannot be
read, keeps mlx-lm's own ``__call__`` and is never touched. ``patch()``
raises only where no class is proven.

``PROVEN_CLASS_CODE`` must hold the fingerprint of every registered class
as the tested release ships it; ``tests/test_mlx_lm_versions.py`` checks
that and prints the lines to add for a newly registered class.
"""

from __future__ import annotations

import ast
import dataclasses
import hashlib
import inspect
import sys
import textwrap
import threading
import warnings
from typing import Any, Callable, Iterator, Optional, cast

from mlx_dualnorm.integrations.mlx_lm import full_attention
from mlx_dualnorm.integrations.mlx_lm.gated_delta import ORIGINAL_NORMALIZE_QK

# The release line the replacements are written and tested against is the
# one with gated_delta.normalize_qk (0.32.x).
_TESTED_RELEASE_LINE = ORIGINAL_NORMALIZE_QK is not None

# "module.Class" -> fingerprints of that class's code in the releases its
# replacement was tested against (mlx-lm 0.32.2). A class no replacement is
# registered for is never looked up.
PROVEN_CLASS_CODE: dict[str, frozenset[str]] = {
    "mlx_lm.models.qwen3.Attention": frozenset({"34907e2e112ce813"}),
    "mlx_lm.models.qwen3_moe.Attention": frozenset({"4e16c15e76853be2"}),
    "mlx_lm.models.qwen3_next.Qwen3NextAttention": frozenset({"a544b2e76685f574"}),
    # The qwen3-like families.
    "mlx_lm.models.Klear.KlearAttention": frozenset({"e817604d7989e839"}),
    "mlx_lm.models.dots1.Dots1Attention": frozenset({"17d977231c921957"}),
    "mlx_lm.models.lfm2.Attention": frozenset({"7060be74fc8cd313"}),
    "mlx_lm.models.lfm2_moe.Attention": frozenset({"7060be74fc8cd313"}),
    "mlx_lm.models.mellum.Attention": frozenset({"92dbde994837d240"}),
    "mlx_lm.models.exaone4.Attention": frozenset({"37f8cc96b4991df4"}),
    "mlx_lm.models.exaone_moe.Attention": frozenset({"b828a36360e8400c"}),
    "mlx_lm.models.apertus.ApertusAttention": frozenset({"efc8e462b2bddb90"}),
    "mlx_lm.models.glm4_moe.Attention": frozenset({"9d06b9fafdb7e8ec"}),
    "mlx_lm.models.laguna.Attention": frozenset({"60fb9d38cacbd31d"}),
    "mlx_lm.models.step3p5.Step3p5Attention": frozenset({"5d0d3263850a18f5"}),
    "mlx_lm.models.llama4_text.Attention": frozenset({"597f81c27a6c8334"}),
    # The q/k norm shapes of the other attention families.
    "mlx_lm.models.afmoe.Attention": frozenset({"efa0ed975ac6b0f0"}),
    "mlx_lm.models.openelm.Attention": frozenset({"0f30cf7b211c85ff"}),
    "mlx_lm.models.bailing_moe.BailingMoeAttention": frozenset({"94da0eaaa09d4433"}),
    "mlx_lm.models.bailing_moe_linear.Attention": frozenset({"ceed7b607872e6a6"}),
    "mlx_lm.models.bailing_moe_linear.LinearAttention": frozenset({"824159b753b2f394"}),
    "mlx_lm.models.bailing_hybrid.LinearAttention": frozenset({"ff076f8aa35db42f"}),
    "mlx_lm.models.gemma3_text.Attention": frozenset({"7249f1cd6947f5b4"}),
    "mlx_lm.models.plamo3.Attention": frozenset({"6352e4ea09eae318"}),
    "mlx_lm.models.minimax_m3_vl.Attention": frozenset({"45e37ba9a08f9c3c"}),
    "mlx_lm.models.gemma3n.Gemma3nAttention": frozenset({"efb8b78dab8b9cc9"}),
    "mlx_lm.models.gemma4_text.Attention": frozenset({"7fa304164396388e"}),
    "mlx_lm.models.gear.Attention": frozenset({"6486530eb1372472"}),
    "mlx_lm.models.gear.ConvKVGatedMixer": frozenset({"c97f2d4dca173e9e"}),
    "mlx_lm.models.olmo2.Attention": frozenset({"1e2f8b6d9f97bc03"}),
    "mlx_lm.models.olmoe.Attention": frozenset({"9505918a2f598c82"}),
    "mlx_lm.models.olmo3.Olmo3Attention": frozenset({"9658e321fb42fbe4"}),
    "mlx_lm.models.minimax.MiniMaxAttention": frozenset({"df5ad51909f311b3"}),
    "mlx_lm.models.olmo_hybrid.Attention": frozenset({"b3a396304e5d8c50"}),
    # Classes of a layer's parts that replacements reproduce rather than
    # call (RoPE with frequency tables, the models' own norms): on an older
    # mlx-lm a layer engages only where each of its mlx-lm parts is proven
    # (SuScaledRoPE, Llama3RoPE and YarnRoPE differ in 0.31.3).
    "mlx_lm.models.rope_utils.SuScaledRoPE": frozenset({"e9648aa9b4864bef"}),
    "mlx_lm.models.rope_utils.Llama3RoPE": frozenset({"731a2d96080ffbd1"}),
    "mlx_lm.models.rope_utils.YarnRoPE": frozenset({"fb04917870ff4bc1"}),
    "mlx_lm.models.rope_utils.ProportionalRoPE": frozenset({"bc03866e392b0ba7"}),
    "mlx_lm.models.gemma3_text.RMSNorm": frozenset({"6c3c574d30c36e7f"}),
    "mlx_lm.models.minimax_m3_vl.GemmaRMSNorm": frozenset({"adbb22aaa896211e"}),
    "mlx_lm.models.gear.GearRMSNorm": frozenset({"d99caa3cfb342a50"}),
    "mlx_lm.models.plamo3.RMSNorm": frozenset({"75e93c0d47fa5631"}),
    "mlx_lm.models.step3p5.ZeroCenteredRMSNorm": frozenset({"8226f03d8acf1c4b"}),
    # Caches a replacement may write itself (their update_and_fetch differs
    # in 0.31.3: it always slices to the offset).
    "mlx_lm.models.cache.KVCache": frozenset({"2d21d60f84e45b13"}),
    "mlx_lm.models.cache.BatchKVCache": frozenset({"2660fd33c5706ca5"}),
    "mlx_lm.models.cache.RotatingKVCache": frozenset({"6914336fa9de5d7d"}),
    "mlx_lm.models.cache.BatchRotatingKVCache": frozenset({"a10250b87c3a346f"}),
}

UNPROVEN_REASON = (
    "its code in this mlx-lm is not the code the patch reproduces "
    "(fingerprint {fingerprint}, not one recorded for it)"
)

_FILTER_MARKER = "_mlx_dualnorm_release_filter"

# The family registry's generator of ``(class, how it is replaced)``
# entries, one per registered class the installed mlx-lm has.
_REGISTRY_GENERATOR = "_attention_classes"


def registered_entries() -> Iterator[tuple]:
    """``(class, how it is replaced)`` for every registered attention class
    the patch may install on (on an older mlx-lm, the proven ones only)."""
    generator: Callable[[], Iterator[tuple]] = getattr(full_attention, _REGISTRY_GENERATOR)
    return generator()


def registered_classes() -> list[type]:
    return [entry[0] for entry in registered_entries()]


def install_release_filter() -> None:
    """On an mlx-lm older than the replacements' release line: narrows the
    registry's generator, for the patch and everything that reads it, to
    the classes whose code is proven (:func:`proven_only`)."""
    setattr(
        full_attention, _REGISTRY_GENERATOR,
        proven_only(getattr(full_attention, _REGISTRY_GENERATOR)),
    )


def class_name(attention_class: type) -> str:
    return f"{attention_class.__module__}.{attention_class.__qualname__}"


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


_fingerprints: dict[type, Optional[str]] = {}  # a class's code does not change


def code_fingerprint(attention_class: type) -> Optional[str]:
    """16 hex digits of the SHA-256 of the parsed source (docstrings
    dropped, positions left out) of the class and of every base it has
    from the same package (a ``__call__`` or ``__init__`` it inherits from
    another mlx-lm class is its code too), or None where a source cannot be
    read."""
    if attention_class in _fingerprints:
        return _fingerprints[attention_class]
    fingerprint = _fingerprint_of_source(attention_class)
    _fingerprints[attention_class] = fingerprint
    return fingerprint


def _fingerprint_of_source(attention_class: type) -> Optional[str]:
    package = attention_class.__module__.split(".", 1)[0]
    digest = hashlib.sha256()
    for cls in attention_class.__mro__:
        if cls.__module__.split(".", 1)[0] != package:
            continue  # MLX's nn.Module, object: not the model file's code
        try:
            source = textwrap.dedent(inspect.getsource(cls))
            tree = _without_docstrings(ast.parse(source))
        except (OSError, TypeError, SyntaxError):
            return None
        digest.update(stable_dump(tree).encode())
    return digest.hexdigest()[:16]


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


def is_proven(attention_class: type) -> bool:
    fingerprint = code_fingerprint(attention_class)
    return fingerprint is not None and fingerprint in PROVEN_CLASS_CODE.get(
        class_name(attention_class), frozenset()
    )


_tested_verdicts: dict[type, bool] = {}


def code_is_tested(mlx_lm_class: type) -> bool:
    """Whether a replacement may reproduce ``mlx_lm_class``'s code (an
    attention class, or a part of a layer such as a norm or RoPE class): on
    the tested release line always, on an older mlx-lm only where the
    class's code is proven. Cache classes whose update the package performs
    itself need :func:`is_proven` on every release instead. One dict lookup
    after the first call."""
    verdict = _tested_verdicts.get(mlx_lm_class)
    if verdict is None:
        verdict = _TESTED_RELEASE_LINE or is_proven(mlx_lm_class)
        _tested_verdicts[mlx_lm_class] = verdict
    return verdict


# Registered classes this release's filter has kept from the patch, with
# the reason; read by the engagement tally.
unproven_classes: dict[type, str] = {}
_unproven_lock = threading.Lock()


PARTS_UNPROVEN = "a part of it (a norm or RoPE of mlx-lm's) is not the tested code on this mlx-lm"


def parts_are_tested(layer: object) -> bool:
    """Whether every direct part of ``layer`` whose class is mlx-lm's (a
    model file's norm, a rope_utils RoPE) has the tested code."""
    values = layer.values() if isinstance(layer, dict) else ()
    for part in values:
        part_class = type(part)
        if part_class.__module__.split(".", 1)[0] == "mlx_lm" and not code_is_tested(part_class):
            return False
    return True


def _with_tested_parts(entry: tuple) -> tuple:
    """A registry entry whose family also requires :func:`parts_are_tested`
    of a layer (entries without a family's ``engages`` are returned as
    they are: their replacements take MLX's own norm and RoPE only)."""
    family = entry[1] if len(entry) > 1 else None
    engages = getattr(family, "engages", None)
    if not (dataclasses.is_dataclass(family) and callable(engages)):
        return entry

    def engages_with_tested_parts(attention) -> bool:
        return parts_are_tested(attention) and engages(attention)

    refusal = getattr(family, "refusal", None)
    changes: dict = {"engages": engages_with_tested_parts}
    if isinstance(refusal, str):
        changes["refusal"] = f"{refusal}; or {PARTS_UNPROVEN}"
    return (entry[0], dataclasses.replace(cast(Any, family), **changes), *entry[2:])


def proven_only(registered_classes):
    """``registered_classes`` (a generator function of ``(class, ...)``
    tuples) narrowed to the classes whose code is proven, recording the
    others in ``unproven_classes``; each family kept also requires its
    layer's mlx-lm parts to be proven (:func:`parts_are_tested`)."""
    if getattr(registered_classes, _FILTER_MARKER, False):
        return registered_classes

    def proven_classes() -> Iterator[tuple]:
        for entry in registered_classes():
            attention_class = entry[0]
            if is_proven(attention_class):
                with _unproven_lock:
                    unproven_classes.pop(attention_class, None)
                yield _with_tested_parts(entry)
            else:
                with _unproven_lock:
                    unproven_classes[attention_class] = UNPROVEN_REASON.format(
                        fingerprint=code_fingerprint(attention_class)
                    )

    setattr(proven_classes, _FILTER_MARKER, True)
    proven_classes.__wrapped__ = registered_classes
    return proven_classes


_said_what_is_left = False


def say_what_is_left_once(
    operation: str, installed: str, missing: str, engaged: list[str]
) -> None:
    """Warns once per process that this mlx-lm gets attention layers only:
    which classes engage, which are left, and that no gated-delta fold runs."""
    global _said_what_is_left
    if _said_what_is_left:
        return
    _said_what_is_left = True
    left = sorted(class_name(attention_class) for attention_class in unproven_classes)
    warnings.warn(
        f"[{operation}] {installed} has no {missing}: gated-delta layers run mlx-lm's own "
        f"code (no fold); attention layers of {len(engaged)} class"
        f"{'es' if len(engaged) != 1 else ''} engage ({', '.join(sorted(engaged))})"
        + (
            f"; {len(left)} left to mlx-lm, their code differing from what the patch "
            f"reproduces ({', '.join(left)})"
            if left
            else ""
        )
        + "; mlx-lm 0.32.0 to 0.32.2 patch all of it: pip install 'mlx-lm==0.32.2'",
        RuntimeWarning,
        stacklevel=4,  # the caller of patch()
    )


def installed_mlx_lm(package: str) -> str:
    version = getattr(sys.modules.get(package), "__version__", None)
    return f"mlx-lm {version}" if isinstance(version, str) else "the installed mlx-lm"
