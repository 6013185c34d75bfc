"""mlx-lm sharded over ``mx.distributed``, with and without the patch: the
rank program of ``tests/mlx_lm_integration/test_mlx_lm_distributed.py``.

This file, run as a script, is what every rank of an ``mlx.launch`` job
runs (``PROGRAM``, handed to :func:`helpers.launch.launch`).
``check`` builds small random models of the mlx-lm families the patch engages that can be split over ranks (``FAMILIES``), runs
each in every arrangement of ``SCENARIOS`` (unsharded; tensor-parallel by
``Model.shard``, patched before the model is built or only after it was
sharded; pipeline-parallel by ``pipeline`` where the family has it), greedy
through mlx-lm's ``generate_step``, and writes per rank the tokens, the
logits of every step and how often the package's objects ran per forward
pass.

The check's arrays go to ``rank<r>.npz`` (``family/scenario`` keys, steps x
vocabulary logits) and the rest to ``rank<r>.json`` in the ``--out``
folder; :func:`load_check_results` reads both back.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import functools
import json
import sys
import time
from pathlib import Path
from typing import Callable, Optional, Sequence

# Run as a script (each rank), the tests folder is not on the path: this file's helpers are.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from helpers.mlx_lm_families import (  # noqa: E402
    ATTENTION_FAMILY_CONFIGS,
    QWEN3_LIKE_CONFIGS,
    QWEN3_LIKE_DTYPE_NAMES,
    ROPE_ONLY_CONFIGS,
    ROPE_ONLY_DTYPE_NAMES,
)

PROGRAM = (str(Path(__file__).resolve()),)  # what the launcher runs with this interpreter
PROMPT_LENGTH = 12
SEED = 20261201

_TINY_DECODER = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "rms_norm_eps": 1e-6,
    "vocab_size": 512,
    "max_position_embeddings": 4096,
    "tie_word_embeddings": False,
}
_QWEN3 = {
    "model_type": "qwen3",
    **_TINY_DECODER,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 128,
    "rope_theta": 1_000_000.0,
}
_QWEN3_MOE = {
    **_QWEN3,
    "model_type": "qwen3_moe",
    "num_experts": 4,
    "num_experts_per_tok": 2,
    "decoder_sparse_step": 1,
    "mlp_only_layers": [],
    "moe_intermediate_size": 32,
    "norm_topk_prob": True,
}
_GATED_DELTA_HEADS = {
    "linear_num_key_heads": 4,
    "linear_key_head_dim": 128,
    "linear_num_value_heads": 8,
    "linear_value_head_dim": 64,
    "linear_conv_kernel_dim": 4,
}
_QWEN3_5_TEXT = {
    "model_type": "qwen3_5_text",
    **_TINY_DECODER,
    **_GATED_DELTA_HEADS,
    "num_hidden_layers": 4,
    "full_attention_interval": 4,  # three gated-delta layers, then full attention
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 128,
    "num_experts": 0,
}
_QWEN3_5_MOE_TEXT = {
    **_QWEN3_5_TEXT,
    "model_type": "qwen3_5_moe_text",
    "num_experts": 4,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 32,
    "shared_expert_intermediate_size": 64,
}
_KIMI_K3_TEXT = {
    "model_type": "kimi_linear",
    **_TINY_DECODER,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "linear_attn_config": {
        "num_heads": 4,
        "head_dim": 128,
        "short_conv_kernel_size": 4,
        "kda_layers": [1, 2, 3],  # layers 0-2 gated-delta, layer 3 MLA
    },
    "kv_lora_rank": 32,
    "qk_nope_head_dim": 32,
    "qk_rope_head_dim": 16,
    "v_head_dim": 32,
}


@dataclasses.dataclass(frozen=True)
class Family:
    """A tiny random model of one mlx-lm family, config.json-style."""

    config: dict
    dtype_name: str  # float32 where MLX's CPU gather_mm (the experts) needs it
    # How the pipeline-parallel split is reached from the model, or None
    # where the family has no pipeline method.
    pipeline_owner: Optional[Callable] = None
    # False where shard() swaps the q/k norms for sharded ones the package
    # does not compute (minimax's ShardedRMSNorm, an all-sum over ranks):
    # tensor-parallel layers then run mlx-lm's own code.
    tensor_parallel_engages: bool = True

    @property
    def dtype(self):
        import mlx.core as mx

        return getattr(mx, self.dtype_name)


def _inner_model(model):
    return model.model


def _language_model_inner(model):
    return model.language_model.model


FAMILIES = {
    "qwen3": Family(_QWEN3, "bfloat16"),
    "qwen3_moe": Family(_QWEN3_MOE, "float32", _inner_model),
    "qwen3_5": Family({"model_type": "qwen3_5", "text_config": _QWEN3_5_TEXT}, "bfloat16",
                      _language_model_inner),
    "qwen3_5_moe": Family(
        {"model_type": "qwen3_5_moe", "text_config": _QWEN3_5_MOE_TEXT}, "float32",
        _language_model_inner,
    ),
    "kimi_k3": Family({"model_type": "kimi_k3", "text_config": _KIMI_K3_TEXT}, "float32",
                      _inner_model),
    # Of the families with qwen3's prework in other classes, those with shard.
    "glm4_moe": Family(QWEN3_LIKE_CONFIGS["glm4_moe"], QWEN3_LIKE_DTYPE_NAMES["glm4_moe"],
                       _inner_model),
    "exaone_moe": Family(
        {**QWEN3_LIKE_CONFIGS["exaone_moe"], "layer_types": ["full_attention"] * 2},
        QWEN3_LIKE_DTYPE_NAMES["exaone_moe"],
    ),
    "step3p5": Family(
        {**QWEN3_LIKE_CONFIGS["step3p5"], "rope_scaling": None, "yarn_only_types": None},
        QWEN3_LIKE_DTYPE_NAMES["step3p5"],
    ),
    # Of the other attention shapes, those with shard.
    "minimax": Family(ATTENTION_FAMILY_CONFIGS["minimax"], "float32",
                      tensor_parallel_engages=False),
    "minimax_m3_vl": Family(ATTENTION_FAMILY_CONFIGS["minimax_m3_vl"], "float32",
                            _language_model_inner),
    # Of the families without q/k norms, those with shard.
    "llama": Family(ROPE_ONLY_CONFIGS["llama"], ROPE_ONLY_DTYPE_NAMES["llama"]),
    "qwen2": Family(ROPE_ONLY_CONFIGS["qwen2"], ROPE_ONLY_DTYPE_NAMES["qwen2"], _inner_model),
    "gpt_oss": Family(ROPE_ONLY_CONFIGS["gpt_oss"], ROPE_ONLY_DTYPE_NAMES["gpt_oss"]),
    "ministral3": Family(ROPE_ONLY_CONFIGS["ministral3"], ROPE_ONLY_DTYPE_NAMES["ministral3"],
                         _inner_model),
}
"""The mlx-lm families with a ``shard`` method whose q/k prework the patch
replaces (full-attention q/k norm + RoPE, gated-delta ``normalize_qk``, the
q/k norm pair of the other attention shapes, or several), each as a tiny
random model. ``qwen3_5_moe`` is ``qwen3_5``'s model class with a
mixture-of-experts MLP; ``kimi_k3`` has gated-delta layers and an MLA layer
the patch leaves alone. ``glm4_moe`` (whose Model ``solar_open`` runs),
``exaone_moe`` (RoPE on every layer) and ``step3p5`` (no YaRN) have every
attention layer engaged; ``minimax`` and ``minimax_m3_vl`` are the tiny
models of :mod:`helpers.mlx_lm_families`;
``llama``, ``qwen2`` and ``ministral3`` (both with pipeline) and
``gpt_oss`` those of
:mod:`helpers.mlx_lm_families`, without q/k
norms."""

# (name, parallelism, when the patch is made)
UNSHARDED, TENSOR, PIPELINE = "unsharded", "tensor", "pipeline"
PATCH_NEVER, PATCH_BEFORE_BUILD, PATCH_AFTER_SHARD = "unpatched", "patched", "patched_after_shard"
SCENARIOS = (
    ("unsharded_unpatched", UNSHARDED, PATCH_NEVER),
    ("tensor_unpatched", TENSOR, PATCH_NEVER),
    ("tensor_patched", TENSOR, PATCH_BEFORE_BUILD),
    ("tensor_patched_after_shard", TENSOR, PATCH_AFTER_SHARD),
    ("pipeline_unpatched", PIPELINE, PATCH_NEVER),
    ("pipeline_patched", PIPELINE, PATCH_BEFORE_BUILD),
    ("pipeline_patched_after_split", PIPELINE, PATCH_AFTER_SHARD),
)


def family_config(name: str) -> dict:
    """The config of ``FAMILIES[name]`` (a fresh copy)."""
    return copy.deepcopy(FAMILIES[name].config)


# ---- Counting the package's calls -------------------------------------------


class CallCounter:
    """Counts calls of the package's two compiled classes (the gated-delta
    dual norm and the full-attention norm + RoPE, called plain or with the
    KV-cache write) and of the model's own class (forward passes), by
    wrapping those methods for the duration of a ``with`` block; the real
    objects run."""

    def __init__(self, model_class) -> None:
        from mlx_dualnorm import CompiledDualHeadNorm, CompiledDualHeadNormRope

        # (count, class, method): a decode step's norm + RoPE is one call of
        # either method.
        self.targets = (
            ("dual_head_norm", CompiledDualHeadNorm, "__call__"),
            ("dual_head_norm_rope", CompiledDualHeadNormRope, "__call__"),
            ("dual_head_norm_rope", CompiledDualHeadNormRope, "apply_with_cache"),
            ("forward", model_class, "__call__"),
        )
        self.reset()
        self._originals: list = []

    def reset(self) -> None:
        self.counts = dict.fromkeys((name for name, _, _ in self.targets), 0)

    def __enter__(self) -> "CallCounter":
        for name, target, method in self.targets:
            self._originals.append((target, method, target.__dict__.get(method)))
            inherited = getattr(target, method)

            def counting(*args, _name=name, _call=inherited, **kwargs):
                self.counts[_name] += 1
                return _call(*args, **kwargs)

            setattr(target, method, functools.wraps(inherited)(counting))
        return self

    def __exit__(self, *exc_info) -> None:
        while self._originals:
            target, method, original = self._originals.pop()
            if original is None:
                delattr(target, method)
            else:
                setattr(target, method, original)


def layer_kinds(model) -> dict:
    """How many of the layers this rank runs are gated-delta layers, how
    many are full-attention layers of a class whose q/k norm + RoPE the
    patch makes one call, and how many are attention layers of the other
    shapes whose q/k norm pair, as they are now, it makes one call (read
    from the integration's registry: a test may look inside it)."""
    from mlx_dualnorm.integrations.mlx_lm import (
        norm_after_transpose, norm_before_transpose, registry, whole_projection,
    )

    norm_pair_modules = {
        module.__name__
        for module in (norm_after_transpose, norm_before_transpose, whole_projection)
    }
    families = registry.families_by_class()
    gated_delta = full_attention = norm_pair = 0
    for layer in model.layers:
        if layer is None:  # another pipeline rank's layer
            continue
        attention = getattr(layer, "self_attn", None)
        family = next(
            (families[cls] for cls in type(attention).__mro__ if cls in families), None
        )
        if getattr(layer, "is_linear", False):
            gated_delta += 1
        elif family is None:
            continue
        elif family.call.__module__ not in norm_pair_modules:
            full_attention += 1
        elif family.engages(attention):
            norm_pair += 1
    return {"gated_delta": gated_delta, "full_attention": full_attention, "norm_pair": norm_pair}


# ---- The rank program: check -------------------------------------------------


def _build(name: str):
    from helpers.mlx_lm_families import build_model

    family = FAMILIES[name]
    return build_model(family_config(name), seed=SEED, dtype=family.dtype)


def _arrange(model, name: str, parallelism: str, group) -> bool:
    """Splits ``model`` over ``group`` as ``parallelism`` says; False where
    the family cannot be split that way."""
    if parallelism == TENSOR:
        model.shard(group)
    elif parallelism == PIPELINE:
        owner = FAMILIES[name].pipeline_owner
        if owner is None:
            return False
        owner(model).pipeline(group)
    return True


def _warm_up(model, prompt) -> None:
    """One patched prefill, so the package's objects for this family's
    constants are built and probed before anything is counted (a probe runs
    the package's object once more, outside any layer)."""
    from mlx_dualnorm.integrations import mlx_lm as integration
    from mlx_dualnorm.commands.shared.generation import greedy_generate

    with integration.patch():
        greedy_generate(model, prompt, 1)


def _generate(model, prompt, tokens: int, counter: CallCounter) -> dict:
    """Greedy tokens, the logits of every step and the package's calls."""
    import mlx.core as mx

    from mlx_dualnorm.commands.shared.generation import greedy_generate

    counter.reset()
    trace = greedy_generate(model, prompt, tokens)
    logits = mx.concatenate([step.reshape(1, -1) for step in trace.step_logits])
    return {
        "tokens": trace.token_ids,
        "logits": logits,
        "calls": dict(counter.counts),
    }


def run_check(families: Sequence[str], tokens: int, group, log=None) -> tuple[dict, dict]:
    """Every scenario of every family on this rank: (json-ready results,
    logits arrays keyed ``family/scenario``)."""
    from helpers.mlx_lm_families import prompt_token_ids
    from mlx_dualnorm.integrations import mlx_lm as integration

    results: dict = {}
    arrays: dict = {}
    for name in families:
        config = family_config(name)
        vocabulary = config.get("text_config", config)["vocab_size"]
        prompt = prompt_token_ids(vocabulary, PROMPT_LENGTH)
        results[name] = {}
        for scenario, parallelism, patching in SCENARIOS:
            if parallelism == PIPELINE and FAMILIES[name].pipeline_owner is None:
                continue
            started = time.perf_counter()
            integration.unpatch()
            if patching == PATCH_BEFORE_BUILD:
                integration.patch()
            model = _build(name)
            if scenario == SCENARIOS[0][0]:
                _warm_up(model, prompt)
            _arrange(model, name, parallelism, group)
            if patching == PATCH_AFTER_SHARD:
                integration.patch()
            with CallCounter(type(model)) as counter:
                outcome = _generate(model, prompt, tokens, counter)
            integration.unpatch()
            arrays[f"{name}/{scenario}"] = outcome.pop("logits")
            results[name][scenario] = {**outcome, "layers": layer_kinds(model)}
            if log is not None:
                log(f"{name} {scenario}: {time.perf_counter() - started:.2f} s")
    return results, arrays


def load_check_results(folder: Path, ranks: int) -> list[tuple[dict, dict]]:
    """Per rank, the (results, logits arrays) ``check`` wrote to ``folder``."""
    import mlx.core as mx

    loaded = []
    for rank in range(ranks):
        results = json.loads((Path(folder) / f"rank{rank}.json").read_text())
        arrays = mx.load(str(Path(folder) / f"rank{rank}.npz"))
        assert isinstance(arrays, dict)  # an .npz loads as a dict of arrays
        loaded.append((results, {key.replace("__", "/"): value for key, value in arrays.items()}))
    return loaded


def _check_main(arguments, group) -> int:
    import mlx.core as mx

    rank = group.rank()

    def log(line: str) -> None:
        print(f"rank {rank}: {line}", file=sys.stderr, flush=True)

    results, arrays = run_check(arguments.families, arguments.tokens, group, log)
    out = Path(arguments.out)
    mx.savez(str(out / f"rank{rank}.npz"), **{k.replace("/", "__"): v for k, v in arrays.items()})
    document = {"rank": rank, "size": group.size(), "tokens": arguments.tokens, "families": results}
    (out / f"rank{rank}.json").write_text(json.dumps(document, indent=1))
    print(f"rank {rank} of {group.size()}: {len(arrays)} runs written", flush=True)
    return 0


# ---- Command line ------------------------------------------------------------


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="mlx_lm_ranks.py",
        description="One rank of mlx-lm sharded over mx.distributed, patched and not "
        "(start it with mlx.launch).",
    )
    commands = parser.add_subparsers(dest="command", required=True)
    check = commands.add_parser("check", help="tokens, logits and package calls of every scenario")
    check.add_argument("--families", type=lambda text: text.split(","), default=list(FAMILIES))
    check.add_argument("--tokens", type=int, default=4)
    check.add_argument("--out", required=True, help="folder for rank<r>.json / rank<r>.npz")
    return parser


def main(argv: Optional[Sequence[str]] = None) -> int:
    import mlx.core as mx

    arguments = _parser().parse_args(argv)
    unknown = [name for name in arguments.families if name not in FAMILIES]
    if unknown:
        raise SystemExit(f"unknown families {unknown}; choose from {', '.join(FAMILIES)}")
    return _check_main(arguments, mx.distributed.init(strict=True, backend="ring"))


if __name__ == "__main__":
    sys.exit(main())
