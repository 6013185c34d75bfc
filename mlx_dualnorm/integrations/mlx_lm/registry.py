"""What the integration covers, in one table, and what proves it may run.

Every replacement restates some of mlx-lm's (or MLX's) code: its
attention class's ``__call__``, the ``__call__`` of the norm and RoPE
classes whose work it does itself, a cache's update, ``normalize_qk``.
Each such function is a PIECE, named ``module.Class.attribute`` (or
``module.function``), and :data:`RECORDED_CODE` holds the fingerprint of
each piece as the replacements were tested against it (mlx-lm 0.32.2 on
MLX 0.32.4). A piece is PROVEN where the function the program would run
now has a recorded fingerprint (:mod:`.fingerprints` says how it is
taken). Nothing engages on a piece that is not proven:

* an attention class is patched only where every piece of its
  :class:`AttentionFamily` is proven (checked once per class at each
  ``patch()``);
* a layer engages only where each part of it whose class is in
  :data:`REPRODUCED_PART_CLASSES` (its norms and RoPE) has a proven
  ``__call__`` and MLX's ``mx.fast.rms_norm`` and ``mx.fast.rope`` are
  MLX's own (proven at the layer's first call; what each resolved to is
  then tested by identity at every call, the layer decided again where
  one differs);
* a cache is written by the one call only where the methods of
  :data:`WRITTEN_CACHES` that its class resolves to are the recorded code
  of one entry (by code, whatever the class's name), each still the
  function proven (identity tests per call) and the object holds none of
  those methods itself;
* the gated-delta fold only where ``normalize_qk`` is proven and
  ``mx.fast.rms_norm`` is MLX's own (tested at every call).

So a newer mlx-lm, or a user's change to any of these, runs its own code
bit for bit, and what did not change keeps the package's path. Adding a
family: docs/mlx-lm.md, "Adding a family".
"""

from __future__ import annotations

import dataclasses
import importlib
import threading
from typing import Callable, Iterable, Optional

from mlx_dualnorm.integrations.mlx_lm._shared import REPLACEMENT_MARKER
from mlx_dualnorm.integrations.mlx_lm.fingerprints import function_fingerprint, live_function
from mlx_dualnorm.integrations.mlx_lm.state import STATE

# ---- The recorded code -----------------------------------------------------------

# piece -> the fingerprints of the code the replacements were tested
# against. tests/mlx_lm_integration/test_mlx_lm_versions.py fails, printing the lines to add,
# where a registered piece of the tested release is missing here.
RECORDED_CODE: dict[str, frozenset[str]] = {
    # The attention classes' __call__.
    "mlx_lm.models.qwen3.Attention.__call__": frozenset({"5e7c7546450bf9c8"}),
    "mlx_lm.models.qwen3_moe.Attention.__call__": frozenset({"5e7c7546450bf9c8"}),
    "mlx_lm.models.qwen3_next.Qwen3NextAttention.__call__": frozenset({"10391ca1579920ad"}),
    "mlx_lm.models.Klear.KlearAttention.__call__": frozenset({"dfd3e38ece40fa3b"}),
    "mlx_lm.models.dots1.Dots1Attention.__call__": frozenset({"5e7c7546450bf9c8"}),
    "mlx_lm.models.lfm2.Attention.__call__": frozenset({"40fcf49777f43c24"}),
    "mlx_lm.models.lfm2_moe.Attention.__call__": frozenset({"40fcf49777f43c24"}),
    "mlx_lm.models.mellum.Attention.__call__": frozenset({"5e7c7546450bf9c8"}),
    "mlx_lm.models.exaone4.Attention.__call__": frozenset({"40a01f304a871c77"}),
    "mlx_lm.models.exaone_moe.Attention.__call__": frozenset({"40a01f304a871c77"}),
    "mlx_lm.models.apertus.ApertusAttention.__call__": frozenset({"dfd3e38ece40fa3b"}),
    "mlx_lm.models.glm4_moe.Attention.__call__": frozenset({"95515e9b94c4affd"}),
    "mlx_lm.models.laguna.Attention.__call__": frozenset({"4fccd35f2d712f41"}),
    "mlx_lm.models.step3p5.Step3p5Attention.__call__": frozenset({"dc11a9265c1c5e23"}),
    "mlx_lm.models.llama4_text.Attention.__call__": frozenset({"172f789c6011ed24"}),
    "mlx_lm.models.afmoe.Attention.__call__": frozenset({"4e19fe755158b4a5"}),
    "mlx_lm.models.openelm.Attention.__call__": frozenset({"01c86da4b1daa2ff"}),
    "mlx_lm.models.bailing_moe.BailingMoeAttention.__call__": frozenset({"9c426bf341f19a88"}),
    "mlx_lm.models.bailing_moe_linear.Attention.__call__": frozenset({"9c426bf341f19a88"}),
    "mlx_lm.models.bailing_moe_linear.LinearAttention.__call__": frozenset({"40b41e88d51abfa1"}),
    "mlx_lm.models.bailing_hybrid.LinearAttention.__call__": frozenset({"c092b948ea7a5237"}),
    "mlx_lm.models.gemma3_text.Attention.__call__": frozenset({"9ad644e47d3a731f"}),
    "mlx_lm.models.plamo3.Attention.__call__": frozenset({"4e26697bdb53ea66"}),
    "mlx_lm.models.minimax_m3_vl.Attention.__call__": frozenset({"7f37ed3303e3ad9b"}),
    "mlx_lm.models.gemma3n.Gemma3nAttention.__call__": frozenset({"367095a04f59aac5"}),
    "mlx_lm.models.gemma4_text.Attention.__call__": frozenset({"c4fa3b994f6513f0"}),
    "mlx_lm.models.gear.Attention.__call__": frozenset({"275cd18d3da7467c"}),
    "mlx_lm.models.gear.ConvKVGatedMixer.__call__": frozenset({"08746572d04ca7be"}),
    "mlx_lm.models.olmo2.Attention.__call__": frozenset({"ea794fce3318da61"}),
    "mlx_lm.models.olmoe.Attention.__call__": frozenset({"ea794fce3318da61"}),
    "mlx_lm.models.olmo3.Olmo3Attention.__call__": frozenset({"70b7183b0f01aedb"}),
    "mlx_lm.models.minimax.MiniMaxAttention.__call__": frozenset({"a95f74805aaca722"}),
    "mlx_lm.models.olmo_hybrid.Attention.__call__": frozenset({"cc35562f9c3bc476"}),
    # The attention classes without q/k norms (rope_only).
    "mlx_lm.models.dbrx.Attention.__call__": frozenset({"de4c17ca63285e75"}),
    "mlx_lm.models.deepseek.DeepseekAttention.__call__": frozenset({"104ff3605249882c"}),
    "mlx_lm.models.ernie4_5.Attention.__call__": frozenset({"3a5c83e05c6ac831"}),
    "mlx_lm.models.ernie4_5_moe.Attention.__call__": frozenset({"3a5c83e05c6ac831"}),
    "mlx_lm.models.exaone.AttentionModule.__call__": frozenset({"ec404845994dc4ed"}),
    "mlx_lm.models.falcon_h1.FalconH1Attention.__call__": frozenset({"3bb65ec68f23c9d5"}),
    "mlx_lm.models.gemma.Attention.__call__": frozenset({"3a5c83e05c6ac831"}),
    "mlx_lm.models.glm.GLMAttention.__call__": frozenset({"5f76ede7b074b16a"}),
    "mlx_lm.models.glm4.Glm4Attention.__call__": frozenset({"3a5c83e05c6ac831"}),
    "mlx_lm.models.granite.Attention.__call__": frozenset({"3a5c83e05c6ac831"}),
    "mlx_lm.models.granitemoe.GraniteMoeAttention.__call__": frozenset({"3a5c83e05c6ac831"}),
    "mlx_lm.models.granitemoehybrid.GraniteMoeHybridAttention.__call__": frozenset({"79c30a6e713eea57"}),
    "mlx_lm.models.helium.HeliumAttention.__call__": frozenset({"3a5c83e05c6ac831"}),
    "mlx_lm.models.internlm2.Attention.__call__": frozenset({"ecc56431055ead57"}),
    "mlx_lm.models.internlm3.Attention.__call__": frozenset({"3a5c83e05c6ac831"}),
    "mlx_lm.models.llama.Attention.__call__": frozenset({"3a5c83e05c6ac831"}),
    "mlx_lm.models.mimo.Attention.__call__": frozenset({"3a5c83e05c6ac831"}),
    "mlx_lm.models.minicpm.Attention.__call__": frozenset({"218e2b817e9945b4"}),
    "mlx_lm.models.mixtral.MixtralAttention.__call__": frozenset({"116663691c55146c"}),
    "mlx_lm.models.nanbeige.Attention.__call__": frozenset({"eb5380330b525a9b"}),
    "mlx_lm.models.nemotron-nas.Attention.__call__": frozenset({"ef59a4b4be44de82"}),
    "mlx_lm.models.nemotron.Attention.__call__": frozenset({"ed469532e2e22892"}),
    "mlx_lm.models.phi3.Attention.__call__": frozenset({"91ff2b9347f566cc"}),
    "mlx_lm.models.phimoe.Attention.__call__": frozenset({"47c5c4cf7065ab14"}),
    "mlx_lm.models.qwen.Attention.__call__": frozenset({"613051b7c92a7ca3"}),
    "mlx_lm.models.qwen2.Attention.__call__": frozenset({"3a5c83e05c6ac831"}),
    "mlx_lm.models.qwen2_moe.Attention.__call__": frozenset({"3a5c83e05c6ac831"}),
    "mlx_lm.models.seed_oss.Attention.__call__": frozenset({"3a5c83e05c6ac831"}),
    "mlx_lm.models.starcoder2.Attention.__call__": frozenset({"3a5c83e05c6ac831"}),
    "mlx_lm.models.telechat3.Telechat3Attention.__call__": frozenset({"35057b4ea3c5da16"}),
    "mlx_lm.models.cohere.Attention.__call__": frozenset({"95515e9b94c4affd"}),
    "mlx_lm.models.cohere2.Attention.__call__": frozenset({"6762fcd872e7f471"}),
    "mlx_lm.models.gemma2.Attention.__call__": frozenset({"1c5708b6d3651730"}),
    "mlx_lm.models.gpt_oss.AttentionBlock.__call__": frozenset({"95e08c42145727d8"}),
    "mlx_lm.models.lille-130m.Lille130mAttention.__call__": frozenset({"736cf0e9c67f5c9b"}),
    "mlx_lm.models.stablelm.Attention.__call__": frozenset({"0d75d40e6a356129"}),
    "mlx_lm.models.ministral3.Attention.__call__": frozenset({"a26b8b04a2516fb3"}),
    # The norm and RoPE classes whose __call__ replacements compute (MLX's own
    # too: the package is built for one MLX release).
    "mlx.nn.layers.normalization.RMSNorm.__call__": frozenset({"39565b8676a38edd"}),
    "mlx.nn.layers.positional_encoding.RoPE.__call__": frozenset({"90ced0919a246eef"}),
    "mlx_lm.models.rope_utils.SuScaledRoPE.__call__": frozenset({"718258621125ce04"}),
    "mlx_lm.models.rope_utils.Llama3RoPE.__call__": frozenset({"d3a9a0288589d39d"}),
    "mlx_lm.models.rope_utils.YarnRoPE.__call__": frozenset({"2ea8c131051611da"}),
    "mlx_lm.models.rope_utils.ProportionalRoPE.__call__": frozenset({"ef7f74e2cca66a16"}),
    "mlx_lm.models.gemma3_text.RMSNorm.__call__": frozenset({"388ec3fb8c2652f1"}),
    "mlx_lm.models.minimax_m3_vl.GemmaRMSNorm.__call__": frozenset({"8d30774e7370eca7"}),
    "mlx_lm.models.gear.GearRMSNorm.__call__": frozenset({"6ff2338d7bcf46a3"}),
    "mlx_lm.models.plamo3.RMSNorm.__call__": frozenset({"d89c83cbaf639db7"}),
    "mlx_lm.models.step3p5.ZeroCenteredRMSNorm.__call__": frozenset({"3f80d31c2eec6af6"}),
    # The caches the one call writes.
    "mlx_lm.models.cache.KVCache.update_and_fetch": frozenset({"14ab338fe9b1118c"}),
    "mlx_lm.models.cache.KVCache.keys_and_values": frozenset({"2886e168efeb5d1e"}),
    "mlx_lm.models.cache.BatchKVCache.update_and_fetch": frozenset({"eecbe4ede43a0ea0"}),
    "mlx_lm.models.cache.BatchKVCache.keys_and_values": frozenset({"63780e14d4589476"}),
    "mlx_lm.models.cache.RotatingKVCache.update_and_fetch": frozenset({"7457ac47da257b25"}),
    "mlx_lm.models.cache.RotatingKVCache._update_in_place": frozenset({"4d31cf2526149db9"}),
    "mlx_lm.models.cache.RotatingKVCache.keys_and_values": frozenset({"2886e168efeb5d1e"}),
    "mlx_lm.models.cache.BatchRotatingKVCache.update_and_fetch": frozenset({"7457ac47da257b25"}),
    "mlx_lm.models.cache.BatchRotatingKVCache._update_in_place": frozenset({"fc1a83c1eca5ba8c"}),
    "mlx_lm.models.cache.BatchRotatingKVCache.keys_and_values": frozenset({"0ddcb02fd016c2a5"}),
    # What the gated-delta fold computes.
    "mlx_lm.models.gated_delta.normalize_qk": frozenset({"0739ab39dc0ad874"}),
}

NORMALIZE_QK_PIECE = "mlx_lm.models.gated_delta.normalize_qk"

# (module that defines it, class) of the parts whose __call__ a replacement
# computes itself when a layer holds one (the norms and RoPEs the shapes
# know); a module that does not import is skipped. Each is looked up where
# it is defined, and only a class of that very module and name counts, so a
# name rebound by the program (``nn.RMSNorm = MyNorm``) changes nothing here.
REPRODUCED_PART_CLASSES = (
    ("mlx.nn.layers.normalization", "RMSNorm"),
    ("mlx.nn.layers.positional_encoding", "RoPE"),
    ("mlx_lm.models.rope_utils", "SuScaledRoPE"),
    ("mlx_lm.models.rope_utils", "Llama3RoPE"),
    ("mlx_lm.models.rope_utils", "YarnRoPE"),
    ("mlx_lm.models.rope_utils", "ProportionalRoPE"),
    ("mlx_lm.models.gemma3_text", "RMSNorm"),
    ("mlx_lm.models.minimax_m3_vl", "GemmaRMSNorm"),
    ("mlx_lm.models.gear", "GearRMSNorm"),
    ("mlx_lm.models.plamo3", "RMSNorm"),
    ("mlx_lm.models.step3p5", "ZeroCenteredRMSNorm"),
)

CACHE_MODULE = "mlx_lm.models.cache"
PLAIN_CACHE, BATCHED_CACHE = "plain", "batched"
ROTATING_CACHE, BATCHED_ROTATING_CACHE = "rotating", "batched rotating"

# mlx-lm cache class name -> (the bookkeeping kind the one call keeps for
# it, the methods whose work a decode step of the call does). A class is of
# a kind where each of those methods resolves to recorded code of that
# class's piece (a subclass that overrides none, whatever its name, is of
# its base's kind; one that overrides any keeps its own update).
WRITTEN_CACHES: dict[str, tuple[str, tuple[str, ...]]] = {
    "KVCache": (PLAIN_CACHE, ("update_and_fetch", "keys_and_values")),
    "BatchKVCache": (BATCHED_CACHE, ("update_and_fetch", "keys_and_values")),
    "RotatingKVCache": (
        ROTATING_CACHE, ("update_and_fetch", "_update_in_place", "keys_and_values"),
    ),
    "BatchRotatingKVCache": (
        BATCHED_ROTATING_CACHE, ("update_and_fetch", "_update_in_place", "keys_and_values"),
    ),
}


def cache_kind_of(cache_class: type) -> Optional[tuple[str, tuple[str, ...]]]:
    """(kind, methods) of :data:`WRITTEN_CACHES` whose every method
    ``cache_class`` resolves to recorded code of that entry, or None."""
    for name, (kind, methods) in WRITTEN_CACHES.items():
        if all(
            is_proven_function(f"{CACHE_MODULE}.{name}.{method}", live_function(cache_class, method))
            for method in methods
        ):
            return kind, methods
    return None


def class_name(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


def piece_name(owner: type, attribute: str) -> str:
    return f"{class_name(owner)}.{attribute}"


# (piece, function, its code, its defaults) -> proven: a monkeypatch brings
# another function, a reload (autoreload swaps __code__) another code object,
# an assignment other defaults, so each such state is fingerprinted once.
_verdicts: dict[tuple, bool] = {}
_verdicts_lock = threading.Lock()


def is_proven_function(piece: str, function: object) -> bool:
    """Whether ``function`` is recorded code for ``piece``."""
    key = (
        piece, function, getattr(function, "__code__", None),
        getattr(function, "__defaults__", None),
        repr(getattr(function, "__kwdefaults__", None)),
    )
    try:
        verdict = _verdicts.get(key)
    except TypeError:  # an unhashable stand-in or default: fingerprinted each time
        fingerprint = function_fingerprint(function)
        return fingerprint is not None and fingerprint in RECORDED_CODE.get(piece, ())
    if verdict is None:
        fingerprint = function_fingerprint(function)
        verdict = fingerprint is not None and fingerprint in RECORDED_CODE.get(piece, ())
        with _verdicts_lock:
            _verdicts[key] = verdict
    return verdict


def unproven_attributes(
    owner: type, attributes: Iterable[str], resolve: Callable[[type, str], object] = live_function
) -> list[str]:
    """Those of ``owner``'s ``attributes`` whose live function (as
    ``resolve`` finds it) is not recorded code."""
    return [
        attribute for attribute in attributes
        if not is_proven_function(piece_name(owner, attribute), resolve(owner, attribute))
    ]


def forget_verdicts() -> None:
    """Drops every cached verdict (tests that change :data:`RECORDED_CODE`)."""
    with _verdicts_lock:
        _verdicts.clear()


# ---- The families ------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class AttentionFamily:
    """One attention class the patch covers.

    ``call`` becomes the ``__call__`` of the layers that engage; it calls
    :func:`~.engine.original_call` where a call cannot take the package's
    path. ``engages`` decides for a layer, at its first call, whether the
    layer's norms and RoPE are exactly what ``call`` computes; a layer it
    refuses runs the class's own ``__call__``, and ``refusal`` says why.
    What the class's code reads at every call, ``call`` reads at every
    call too (``switches`` for the flags ``engages`` requires).
    ``pieces`` are the class's attributes whose code ``call`` restates:
    each must be proven (:data:`RECORDED_CODE`) for the class to be patched."""

    module: str  # the mlx-lm module; one that does not import is skipped
    class_name: str
    call: Callable
    engages: Callable[[object], bool]
    refusal: str = "its norms or RoPE are not plain nn.RMSNorm / nn.RoPE"
    pieces: tuple[str, ...] = ("__call__",)
    # (attribute, value) of a layer that the class's own code reads at every
    # call and ``engages`` requires: an engaged layer whose attribute is
    # another value at a call runs the class's own code for that call.
    switches: tuple[tuple[str, object], ...] = ()

    @property
    def name(self) -> str:
        return f"{self.module}.{self.class_name}"

    def attention_class(self) -> Optional[type]:
        """The class in the installed mlx-lm, or None where it has none."""
        return class_of(self.module, self.class_name)


# Every family, in registration order; a class registered twice keeps its
# first family.
_attention_families: list[AttentionFamily] = []


def register_attention_families(*families: AttentionFamily) -> None:
    """Adds ``families`` to what ``patch()`` covers (from its next install
    on). Each ``call`` is marked as a replacement."""
    for family in families:
        setattr(family.call, REPLACEMENT_MARKER, True)
        if family not in _attention_families:
            _attention_families.append(family)


def attention_families() -> tuple[AttentionFamily, ...]:
    """Every registered :class:`AttentionFamily`, in registration order."""
    return tuple(_attention_families)


def families_by_class() -> dict[type, AttentionFamily]:
    """class -> its family, for every registered family the installed
    mlx-lm has, each class once."""
    found: dict[type, AttentionFamily] = {}
    for family in attention_families():
        attention_class = family.attention_class()
        if attention_class is not None and attention_class not in found:
            found[attention_class] = family
    return found


def class_of(module_name: str, name: str) -> Optional[type]:
    """The class ``module_name.name`` of this install, or None where the
    module does not import or has no such class. A module that raises
    anything but ImportError on import (a newer mlx-lm's file that needs a newer MLX) is
    left alone and named in :data:`.state.STATE`'s ``import_failures``."""
    try:
        module = importlib.import_module(module_name)
    except ImportError:  # an mlx-lm without it (or without what it imports)
        return None
    except Exception as error:  # any other failure to import: that module is left alone
        first_line = (str(error).splitlines() or [""])[0]
        if len(first_line) > 48:
            first_line = first_line[:45] + "..."
        STATE.import_failures[module_name] = f"{type(error).__name__}: {first_line}"
        return None
    cls = getattr(module, name, None)
    return cls if isinstance(cls, type) else None


def defined_class(module_name: str, name: str) -> Optional[type]:
    """:func:`class_of`, where the class is the one that module defines
    under that name (not another class bound to the name since)."""
    cls = class_of(module_name, name)
    if cls is None or cls.__module__ != module_name or cls.__qualname__ != name:
        return None
    return cls


_part_classes: Optional[tuple] = None


def reproduced_part_classes() -> tuple:
    """The classes of :data:`REPRODUCED_PART_CLASSES` this install has, as
    their modules define them (found once: class objects do not change)."""
    global _part_classes
    if _part_classes is None:
        found = (defined_class(module_name, name) for module_name, name in REPRODUCED_PART_CLASSES)
        _part_classes = tuple(cls for cls in found if cls is not None)
    return _part_classes


def reproduced_part_class_set() -> frozenset:
    """:func:`reproduced_part_classes` as a set."""
    return frozenset(reproduced_part_classes())


def unproven_cache_methods() -> dict[str, list[str]]:
    """``mlx_lm.models.cache.NAME`` -> the methods of :data:`WRITTEN_CACHES`
    whose code differs, for each class mlx-lm's cache module holds under a
    name there now (whatever its ``__name__``) that is of no kind."""
    unproven = {}
    for name, (_, methods) in WRITTEN_CACHES.items():
        cache_class = class_of(CACHE_MODULE, name)
        if cache_class is None or cache_kind_of(cache_class) is not None:
            continue
        unproven[f"{CACHE_MODULE}.{name}"] = [
            method for method in methods
            if not is_proven_function(
                f"{CACHE_MODULE}.{name}.{method}", live_function(cache_class, method)
            )
        ] or ["its methods"]
    return unproven
