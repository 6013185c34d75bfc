"""Routes mlx-lm's q/k prework through mlx_dualnorm, bit for bit.

* Gated-delta layers (qwen3_next, qwen3_5, kimi_linear, kimi_k3,
  olmo_hybrid, bailing_moe_v3): ``mlx_lm.models.gated_delta.normalize_qk``,
  two ``rms_norm`` graph builds and two scalar multiplies, becomes ONE call
  of :class:`~mlx_dualnorm.CompiledDualHeadNorm`, its scales folded into
  constant weights (:mod:`.gated_delta`).
* Full-attention layers (qwen3, qwen3_moe, qwen3_next's attention): the
  ``rms_norm`` by ``q_norm`` / ``k_norm``, the transpose and ``nn.RoPE``
  become ONE call of :class:`~mlx_dualnorm.CompiledDualHeadNormRope` with
  the layer's own weights and constants (:mod:`.qwen3`, :mod:`.norm_rope`),
  with a decode step's KV-cache write in it (:mod:`.cache_update`); so do
  the other families whose attention has that prework under other names
  (Klear, dots1, lfm2, mellum, exaone4, apertus, glm4_moe, laguna,
  step3p5, llama4_text, ...: :mod:`.qwen3_like`).
* Full-attention layers without q/k norms (llama, qwen2, mixtral, gemma,
  phi3, granite, deepseek, starcoder2, internlm2, ...: :mod:`.rope_only`):
  the transposes and RoPE of q and k, with a decode step's KV-cache write,
  become ONE call of a :class:`~mlx_dualnorm.CompiledDualHeadNormRope`
  made without norms.
* Attention layers of other shapes (afmoe, openelm, the bailing models,
  gemma3_text, gemma3n, gemma4_text, gear, minimax, minimax_m3_vl, olmo2,
  olmo3, olmoe, olmo_hybrid, plamo3): the two q/k norm calls become ONE call
  of :class:`~mlx_dualnorm.CompiledDualHeadNorm` on the same arrays, with
  the weight each norm class passes (:mod:`.head_norms`; the shapes in
  :mod:`.norm_after_transpose`, :mod:`.norm_before_transpose`,
  :mod:`.whole_projection`).

The patch replaces only code it has proven: every function a replacement
restates (the class's ``__call__``, its norms' and RoPE's, the cache's
update, ``normalize_qk``) must be, as the program resolves it now, the
code the package was tested against (:mod:`.registry`). A newer mlx-lm or
a change of the program's own runs its own code, bit for bit, and
:func:`patch` warns once what it left. Anything else the package does not
compute exactly (other dtypes, a RoPE it does not cover, other norms, a
call that raises) runs mlx-lm's own code, never an approximation; each
such reason is logged once, at debug level, to the
``mlx_dualnorm.integrations.mlx_lm`` logger. :func:`report` says what the
patch engaged.

    >>> from mlx_dualnorm.integrations import mlx_lm as dualnorm_mlx_lm
    >>> dualnorm_mlx_lm.patch()            # for the rest of the process
    >>> with dualnorm_mlx_lm.patch(): ...  # or for one block

Importing this package imports mlx-lm; ``import mlx_dualnorm`` does not.
Each layer shape has a module of its own here; :mod:`.registry` lists what
they cover, :mod:`.engine` installs and decides, :mod:`._patching` holds
the public switch.
"""

from __future__ import annotations

from mlx_dualnorm.integrations.mlx_lm._shared import SUPPORTED_MLX_LM

try:
    import mlx_lm  # noqa: F401
except ModuleNotFoundError as missing:
    if missing.name != "mlx_lm":
        raise
    raise ModuleNotFoundError(
        "mlx_dualnorm.integrations.mlx_lm needs mlx-lm, which is not installed: "
        f"pip install 'mlx-lm==0.32.2' (it supports {SUPPORTED_MLX_LM})",
        name="mlx_lm",
    ) from missing

from mlx_dualnorm.integrations.mlx_lm._patching import (  # noqa: E402
    MlxLmPatch,
    clear_cache,
    is_patched,
    patch,
    report,
    unpatch,
)
from mlx_dualnorm.integrations.mlx_lm.report import ClassReport, PatchReport  # noqa: E402
from mlx_dualnorm.integrations.mlx_lm.registry import (  # noqa: E402
    AttentionFamily,
    attention_families,
    register_attention_families,
)
from mlx_dualnorm.integrations.mlx_lm.gated_delta import (  # noqa: E402
    ORIGINAL_NORMALIZE_QK,
    normalize_qk,
)
from mlx_dualnorm.integrations.mlx_lm.engagement import (  # noqa: E402
    NORM_ONLY,
    NORM_ROPE,
    ROPE_ONLY,
    LayerEngagement,
    Recording,
    recording,
)

__all__ = [
    "AttentionFamily",
    "ClassReport",
    "LayerEngagement",
    "MlxLmPatch",
    "NORM_ONLY",
    "NORM_ROPE",
    "ORIGINAL_NORMALIZE_QK",
    "PatchReport",
    "ROPE_ONLY",
    "Recording",
    "attention_families",
    "clear_cache",
    "is_patched",
    "normalize_qk",
    "patch",
    "recording",
    "register_attention_families",
    "report",
    "unpatch",
]
