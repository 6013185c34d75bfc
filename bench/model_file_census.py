"""Census of mlx-lm's model files: which ones the patch engages, and
whether each one still decodes the same bits.

For every model file in ``mlx_lm/models/`` (the utility modules and any
file without ``Model`` and ``ModelArgs`` left out), builds a small random
model and decodes greedily twice: a prompt of 8 tokens, then 7 one-token
steps through mlx-lm's prompt cache, first with mlx-lm as it is, then
inside ``integration.patch()`` with every call of the package's ops
(``CompiledDualHeadNormRope.__call__`` and ``.apply_with_cache``,
``CompiledDualHeadNorm.__call__``) counted; a gated-delta fold's one-time
probe counts as one call. The model: hidden size 64, 4 query and 2
key/value heads of width 16, 2 layers, vocabulary 128, a few experts,
plus the fields a file needs (``CONFIG_OVERRIDES``); the package's own
small config (the tests' ``helpers/mlx_lm_families.py``) for a file it
has one for; a file that wraps another file's language model nests that
file's config. Weights are mlx-lm's initialization from a fixed seed,
norm weights drawn around their initial value, float32 unless
``--dtype`` says otherwise. Each file is then

  engaged          at least one package call, every step's logits the same bits
  not engaged      no package call, the same bits
  MISMATCH         tokens or logits differ: a bug
  patched error    fails only when patched: a bug
  does not build   fails unpatched too (the reason in one line)

Each file runs in a subprocess of its own with a time limit, so a file
that crashes or exits at import stops nothing else; a crash or time-out
counts against the phase it happened in. One line per file, then a
summary; ``--json`` writes every record (calls by op, the patch report's
engaged layers and calls, what it left to mlx-lm, the tokens). Exit
status 1 if any file is a MISMATCH or a patched error.

    .venv/bin/python bench/model_file_census.py [--files a,b,c] [--jobs 2] [--json out.json]
                                                [--dtype float32] [--timeout 120]
"""

from __future__ import annotations

import argparse
import ast
import collections
import concurrent.futures
import contextlib
import copy
import dataclasses
import functools
import importlib
import io
import json
import pathlib
import signal
import subprocess
import sys
import threading
import warnings

import mlx.core as mx
import mlx_lm.models
from mlx_lm.models.cache import make_prompt_cache

from mlx_dualnorm import CompiledDualHeadNorm, CompiledDualHeadNormRope
from mlx_dualnorm.bits import count_bit_differences, same_bits
from mlx_dualnorm.integrations import mlx_lm as integration

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "tests"))
from helpers.mlx_lm_families import (  # noqa: E402  (the small models of every family)
    SYNTHETIC_MODEL_TYPES,
    build_model,
    prompt_token_ids,
    randomize_norm_weights,
    synthetic_model_config,
)

ENGAGED = "engaged"
NOT_ENGAGED = "not engaged"
MISMATCH = "MISMATCH"
PATCHED_ERROR = "patched error"
DOES_NOT_BUILD = "does not build"

UTILITY_MODULES = frozenset({
    "__init__", "activations", "base", "bitlinear_layers", "cache", "gated_delta", "mla",
    "pipeline", "rope_utils", "ssm", "switch_layers",
})
PROMPT_TOKENS = 8
GENERATED_TOKENS = 8
SEED = 20261129
REASON_CHARACTERS = 160

# Every file starts from this (ModelArgs.from_dict keeps the fields its
# class has); the expert counts and the last group fill fields many files
# require, with the values that add the least.
GENERIC_CONFIG = {
    "hidden_size": 64, "num_hidden_layers": 2, "intermediate_size": 128,
    "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "vocab_size": 128,
    "rms_norm_eps": 1e-5, "norm_eps": 1e-5, "layer_norm_eps": 1e-5,
    "layer_norm_epsilon": 1e-5, "max_position_embeddings": 512, "rope_theta": 10_000.0,
    "tie_word_embeddings": False,
    "num_experts": 4, "num_local_experts": 4, "n_routed_experts": 4, "moe_num_experts": 4,
    "num_experts_per_tok": 2, "moe_intermediate_size": 32,
    "shared_expert_intermediate_size": 64,
    "attention_bias": False, "mlp_bias": False, "use_bias": False, "norm_topk_prob": True,
    "n_shared_experts": 1, "num_shared_experts": 1, "n_group": 1, "topk_group": 1,
    "routed_scaling_factor": 1.0, "first_k_dense_replace": 1,
}
_MLA = {"kv_lora_rank": 16, "q_lora_rank": 32, "qk_rope_head_dim": 8, "qk_nope_head_dim": 16,
        "v_head_dim": 16}
_YARN = {"factor": 2.0, "original_max_position_embeddings": 256, "beta_fast": 32, "beta_slow": 1,
         "mscale": 1.0, "mscale_all_dim": 1.0}
_LONGCAT = {
    **_MLA, "zero_expert_type": "identity", "ffn_hidden_size": 128, "moe_topk": 2,
    "expert_ffn_hidden_size": 32, "zero_expert_num": 2, "num_layers": 2,
    "mla_scale_q_lora": True, "mla_scale_kv_lora": True,
}
_KIMI_DELTA = {"kda_layers": [1], "full_attn_layers": [2], "num_heads": 4, "head_dim": 16,
               "short_conv_kernel_size": 4}
_MAMBA = {"state_size": 16, "conv_kernel": 4, "use_conv_bias": True, "time_step_rank": "auto"}

# Files that wrap another file's language model -> that file: its config
# nests as text_config.
LANGUAGE_MODEL_OF = {
    "gemma3": "gemma3_text", "gemma4": "gemma4_text", "kimi_k25": "deepseek_v3",
    "kimi_vl": "deepseek_v3", "lfm2-vl": "lfm2", "mistral3": "llama", "pixtral": "llama",
    "prism_hadamard_qwen35": "qwen3_5", "qwen2_vl": "qwen2", "qwen3_5_moe": "qwen3_5",
    "qwen3_vl": "qwen3", "qwen3_vl_moe": "qwen3_moe",
}

# file -> fields on top of GENERIC_CONFIG (a file the tests' small configs
# cover takes that config instead: SYNTHETIC_MODEL_TYPES).
CONFIG_OVERRIDES: dict[str, dict] = {
    "afm7": {"hidden_dim": 64, "num_layers": 2, "num_kv_reuse_layers": 1, "num_heads": 4,
             "num_kv_heads": 2},
    "baichuan_m1": {"sliding_window": 4, "sliding_window_layers": [0], "conv_window": 2},
    "deepseek_v2": {**_MLA, "rope_scaling": {"type": "yarn", **_YARN}},
    "deepseek_v3": _MLA,
    "deepseek_v32": {**_MLA, "index_head_dim": 16, "index_n_heads": 2, "index_topk": 4},
    "deepseek_v41": {
        "head_dim": 32, "q_lora_rank": 32, "qk_rope_head_dim": 8, "o_groups": 2,
        "o_lora_rank": 16, "index_n_heads": 2, "index_head_dim": 16, "index_topk": 4,
        "sliding_window": 4, "candidate_topk_blocks": 2, "candidate_block_size": 4,
        "hc_mult": 2,
    },
    "glm4_moe_lite": _MLA,
    "glm_moe_dsa": {
        **_MLA, "index_head_dim": 16, "index_n_heads": 2, "index_topk": 4,
        "topk_method": "noaux_tc", "scoring_func": "sigmoid", "moe_layer_freq": 1,
        "rope_parameters": {"rope_theta": 10_000.0, "rope_type": "default"},
    },
    "gpt2": {"n_ctx": 512, "n_embd": 64, "n_head": 4, "n_layer": 2, "n_positions": 512},
    "gpt_bigcode": {"n_embd": 64, "n_layer": 2, "n_inner": 128, "n_head": 4, "n_positions": 512},
    "gpt_neox": {"rotary_emb_base": 10_000, "rotary_pct": 0.25},
    "gptj": {"n_embd": 64, "n_positions": 512, "n_head": 4, "rotary_dim": 8, "n_layer": 2},
    "hunyuan": {
        "moe_topk": 2, "num_shared_expert": 1, "use_mixed_mlp_moe": True, "use_qk_norm": True,
        "use_cla": False, "cla_share_factor": 2,
        "rope_scaling": {"alpha": 1.0, "factor": 1.0, "type": "dynamic"},
    },
    "iquestloopcoder": {"loop_window_size": 4},
    "jamba": {
        "attn_layer_offset": 1, "attn_layer_period": 2, "expert_layer_offset": 1,
        "expert_layer_period": 2, "mamba_d_conv": 4, "mamba_d_state": 16, "mamba_expand": 2,
    },
    "kimi_k3": {**_MLA, "linear_attn_config": _KIMI_DELTA, "num_experts_per_token": 2},
    "kimi_linear": {
        **_MLA, "linear_attn_config": _KIMI_DELTA, "model_max_length": 512,
        "num_experts_per_token": 2,
    },
    "llama4": {  # every fourth layer global
        "num_hidden_layers": 4, "attention_chunk_size": 4, "interleave_moe_layer_step": 2,
        "intermediate_size_mlp": 128, "rope_scaling": None, "use_qk_norm": True,
        "num_experts_per_tok": 1,
    },
    "longcat_flash": {**_LONGCAT, "attention_method": "MLA"},
    "longcat_flash_ngram": _LONGCAT,
    "mamba": _MAMBA,
    "mamba2": {**_MAMBA, "num_heads": 8, "n_groups": 1, "time_step_limit": (0.0, float("inf"))},
    "mimo_v2_flash": {
        "hybrid_layer_pattern": [0, 1], "moe_layer_freq": [0, 1],
        "add_swa_attention_sink_bias": True, "add_full_attention_sink_bias": False,
        "sliding_window_size": 4, "topk_method": "noaux_tc", "scoring_func": "sigmoid",
        "layernorm_epsilon": 1e-5, "swa_rope_theta": 10_000.0, "swa_num_attention_heads": 4,
        "swa_num_key_value_heads": 2, "v_head_dim": 16, "swa_head_dim": 16,
        "swa_v_head_dim": 16, "partial_rotary_factor": 1.0, "attention_value_scale": 0.7,
    },
    "minicpm3": {
        **_MLA, "dim_model_base": 64, "scale_depth": 1.0, "scale_emb": 1.0,
        "rope_scaling": {"original_max_position_embeddings": 256, "short_factor": [1.0] * 4,
                         "long_factor": [1.0] * 4},
    },
    "ministral3": {
        "rope_parameters": {"rope_type": "yarn", "rope_theta": 10_000.0,
                            "llama_4_scaling_beta": 0.1, **_YARN},
    },
    "mistral4": {
        **_MLA,
        "rope_parameters": {"rope_type": "yarn", "rope_theta": 10_000.0,
                            "llama_4_scaling_beta": 0.1, **_YARN},
    },
    "muse_spark": {
        "post_norm_eps": 1e-5, "rope_parameters": {"rope_theta": 10_000.0},
        "layer_rope_theta": [10_000.0, 0], "layer_types": ["sliding_attention", "full_attention"],
        "sliding_window": 4, "final_logit_softcapping": 30.0, "output_multiplier": 1.0,
        "moe_hidden_size": 32, "num_shared_experts": 0,
    },
    "nemotron_h": {
        "mamba_num_heads": 4, "mamba_head_dim": 16, "mamba_proj_bias": False,
        "ssm_state_size": 16, "conv_kernel": 4, "n_groups": 1, "use_conv_bias": True,
        "hybrid_override_pattern": ["M", "*", "E"], "moe_shared_expert_intermediate_size": 32,
    },
    "phi3small": {  # its logits mask token ids up to 100351
        "vocab_size": 100_352, "dense_attention_every_n_layers": 2, "ff_intermediate_size": 128,
        "gegelu_limit": 20.0, "blocksparse_block_size": 32, "blocksparse_num_local_blocks": 2,
        "blocksparse_vert_stride": 2,
    },
    "phixtral": {"num_vocab": 128, "model_dim": 64, "num_heads": 4, "num_layers": 2,
                 "rotary_dim": 8},
    "plamo": {"n_shared_head": 2},
    "prism_hadamard_qwen35": {  # one 2-bit packed projection (zero weights, as built)
        "schema_version": 1, "tensor_namespace": "mlx-lm-text",
        "quantization": {"bits": 2, "group_size": 128, "mode": "affine"},
        "modules": [{"path": "model.layers.0.mlp.down_proj", "embedding": False,
                     "dtype": "float16", "block": 0}],
    },
    "qwen3_5_moe": {"text_config": {"num_experts": 4, "num_experts_per_tok": 2,
                                    "moe_intermediate_size": 32,
                                    "shared_expert_intermediate_size": 32}},
    "recurrent_gemma": {
        "conv1d_width": 4, "logits_soft_cap": 30.0, "num_key_value_heads": 1,
        "attention_window_size": 4, "block_types": ["recurrent", "attention"], "lru_width": 64,
    },
    "rwkv7": {"a_low_rank_dim": 8, "v_low_rank_dim": 8, "gate_low_rank_dim": 8,
              "decay_low_rank_dim": 8},
    "spark2_5": {
        "sliding_window": 4, "hidden_act": "gelu",
        "layer_types": ["sliding_attention", "full_attention"],
        "rope_parameters": {
            "full_attention": {"rope_theta": 10_000.0, "rope_type": "default"},
            "sliding_attention": {"rope_theta": 10_000.0, "rope_type": "default"},
        },
    },
}


# ---- one file, in its own process --------------------------------------------------


def flat_config(file_name: str) -> dict:
    """``file_name``'s own config: the package's small config where it has
    one (its language model's part where that nests), else GENERIC_CONFIG
    with the file's overrides."""
    if file_name in SYNTHETIC_MODEL_TYPES:
        config = synthetic_model_config(file_name)
        return config.get("text_config", config)
    overrides = copy.deepcopy(CONFIG_OVERRIDES.get(file_name, {}))
    return {**copy.deepcopy(GENERIC_CONFIG), **overrides, "model_type": file_name}


def model_config(file_name: str, model_args_class) -> dict:
    """The config.json-style dict of ``file_name``'s small model. A file
    that wraps another file's language model nests that file's config as
    ``text_config`` (its own overrides at top level, but their
    ``text_config`` into the nested one); another file whose ModelArgs
    has a ``text_config`` field nests its own config there."""
    if file_name in SYNTHETIC_MODEL_TYPES:
        return synthetic_model_config(file_name)
    if file_name in LANGUAGE_MODEL_OF:
        overrides = copy.deepcopy(CONFIG_OVERRIDES.get(file_name, {}))
        text_config = {**flat_config(LANGUAGE_MODEL_OF[file_name]),
                       **overrides.pop("text_config", {})}
        return {"model_type": file_name, "vocab_size": text_config["vocab_size"], **overrides,
                "text_config": text_config}
    config = flat_config(file_name)
    if "text_config" in {field.name for field in dataclasses.fields(model_args_class)}:
        return {"model_type": file_name, "text_config": config}
    return config


def import_model_file(file_name: str):
    """``mlx_lm.models.<file_name>``; a file that exits at import raises
    ImportError with the last line it printed."""
    printed = io.StringIO()
    try:
        with contextlib.redirect_stdout(printed):
            return importlib.import_module(f"mlx_lm.models.{file_name}")
    except SystemExit as exit_request:
        said = printed.getvalue().strip().splitlines()
        raise ImportError(f"exits at import: {said[-1] if said else exit_request.code}") from None


def build(file_name: str, dtype: mx.Dtype):
    """``file_name``'s small random model (the file's own module, never a
    remapped model type) and its prompt."""
    config = model_config(file_name, import_model_file(file_name).ModelArgs)
    model = build_model({**config, "model_type": file_name}, seed=SEED, dtype=dtype)
    randomize_norm_weights(model, SEED)
    vocab_size = config.get("vocab_size") or config["text_config"]["vocab_size"]
    return model, prompt_token_ids(vocab_size, PROMPT_TOKENS)


def greedy_decode(model, prompt: mx.array) -> tuple[list[int], list[mx.array]]:
    """Tokens and every step's logits of a greedy decode: the prompt in one
    call, then one token a call through mlx-lm's prompt cache."""
    cache = make_prompt_cache(model)
    logits = model(prompt[None], cache=cache)
    steps, tokens = [logits], []
    for step in range(GENERATED_TOKENS):
        token = mx.argmax(logits[:, -1, :], axis=-1)
        tokens.append(int(token.item()))
        if step + 1 < GENERATED_TOKENS:
            logits = model(token[None], cache=cache)
            steps.append(logits)
    mx.eval(steps)
    return tokens, steps


@contextlib.contextmanager
def counting_package_calls():
    """Counts the calls of the package's ops, by op. Wrapped on the
    classes, so a call through a bound method or a ``functools.partial``
    counts too; a call an op makes of itself does not count again."""
    counted_methods = (
        (CompiledDualHeadNormRope, "__call__"),
        (CompiledDualHeadNormRope, "apply_with_cache"),
        (CompiledDualHeadNorm, "__call__"),
    )
    counts: collections.Counter = collections.Counter()
    inside = threading.local()

    def counting(name, method):
        @functools.wraps(method)
        def counted(self, *args, **kwargs):
            if getattr(inside, "active", False):
                return method(self, *args, **kwargs)
            counts[name] += 1
            inside.active = True
            try:
                return method(self, *args, **kwargs)
            finally:
                inside.active = False

        return counted

    originals = [(owner, name, owner.__dict__[name]) for owner, name in counted_methods]
    for owner, name, method in originals:
        setattr(owner, name, counting(f"{owner.__name__}.{name}", method))
    try:
        yield counts
    finally:
        for owner, name, method in originals:
            setattr(owner, name, method)


def left_to_mlx_lm(report: integration.PatchReport, model) -> str:
    """What the patch left to mlx-lm's code in ``model``'s classes:
    classes unproven, layers left (by reason), calls that fell back."""
    classes_used = {
        f"{type(module).__module__}.{type(module).__qualname__}"
        for _, module in model.named_modules()
    }
    notes = []
    for entry in report.classes:
        if entry.name not in classes_used:
            continue
        name = entry.name.removeprefix("mlx_lm.models.")
        if entry.unproven:
            notes.append(f"{name} unproven ({', '.join(entry.unproven)})")
        notes += [f"{name}: {layers} left ({reason})"
                  for reason, layers in entry.left_layers.items()]
        if entry.fallbacks:
            notes.append(f"{name}: {entry.fallbacks} calls ran mlx-lm's code")
    return "; ".join(notes)


def one_line(error: BaseException) -> str:
    lines = str(error).strip().splitlines()
    return f"{type(error).__name__}: {lines[0] if lines else ''}".rstrip(": ")[:REASON_CHARACTERS]


def first_difference(expected, actual) -> str:
    """Where the patched decode first leaves mlx-lm's bits ('' for nowhere)."""
    expected_tokens, expected_steps = expected
    actual_tokens, actual_steps = actual
    for step, (want, got) in enumerate(zip(expected_steps, actual_steps)):
        if not same_bits(got, want):
            where = "the prompt's" if step == 0 else f"step {step}'s"
            if got.dtype != want.dtype or got.shape != want.shape:
                return f"{where} logits are {got.dtype} {got.shape}, not {want.dtype} {want.shape}"
            return (f"{where} logits differ in {count_bit_differences(got, want)} of "
                    f"{want.size} elements")
    if actual_tokens != expected_tokens:
        return f"tokens {actual_tokens}, not {expected_tokens}"
    return ""


def announce(phase: str) -> None:
    """Tells the parent which phase a crash or a time-out happened in."""
    print(f"PHASE {phase}", flush=True)


def census_of_file(file_name: str, dtype: mx.Dtype) -> dict:
    """One file's record: status, package calls (by op), and the reason."""
    record = {"file": file_name, "status": DOES_NOT_BUILD, "calls": 0, "reason": ""}
    try:
        announce("build")
        model, prompt = build(file_name, dtype)
        announce("unpatched")
        expected = greedy_decode(model, prompt)
    except Exception as error:
        return {**record, "reason": one_line(error)}
    try:
        announce("patched")
        with warnings.catch_warnings():
            # A class left unproven shows in the report, per file.
            warnings.simplefilter("ignore", RuntimeWarning)
            with counting_package_calls() as counts, integration.patch():
                actual = greedy_decode(model, prompt)
                report = integration.report()
    except Exception as error:
        return {**record, "status": PATCHED_ERROR, "reason": one_line(error)}
    calls = sum(counts.values())
    record.update(
        calls=calls, calls_by_op=dict(counts), engaged_layers=report.engaged_layers,
        reported_calls=report.calls + report.folded_calls, left=left_to_mlx_lm(report, model),
        tokens=expected[0],
    )
    difference = first_difference(expected, actual)
    if difference:
        return {**record, "status": MISMATCH, "reason": difference}
    return {**record, "status": ENGAGED if calls else NOT_ENGAGED}


# ---- the parent ------------------------------------------------------------------------


def defines_model(source: str) -> bool:
    """Whether a module's source defines or imports both ``Model`` and
    ``ModelArgs`` at top level (read, not imported: some files crash)."""
    names = set()
    for node in ast.parse(source).body:
        if isinstance(node, ast.ClassDef):
            names.add(node.name)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names.update(alias.asname or alias.name for alias in node.names)
    return {"Model", "ModelArgs"} <= names


def model_files() -> list[str]:
    directory = pathlib.Path(mlx_lm.models.__path__[0])
    return sorted(
        path.stem for path in directory.glob("*.py")
        if path.stem not in UTILITY_MODULES and defines_model(path.read_text())
    )


def crash_reason(returncode: int) -> str:
    if returncode < 0:
        return f"killed by {signal.Signals(-returncode).name}"
    return f"exited with status {returncode}"


def run_in_subprocess(file_name: str, dtype_name: str, timeout: float) -> dict:
    """One file's record from a fresh interpreter; a crash or a time-out
    counts against the phase it happened in."""
    command = [sys.executable, __file__, "--child", file_name, "--dtype", dtype_name]
    try:
        finished = subprocess.run(command, capture_output=True, text=True, timeout=timeout)
        stdout, reason = finished.stdout, crash_reason(finished.returncode)
    except subprocess.TimeoutExpired as expired:
        stdout = expired.stdout.decode() if isinstance(expired.stdout, bytes) else expired.stdout
        reason = f"timed out after {timeout:g} s"
    lines = (stdout or "").splitlines()
    for line in reversed(lines):
        if line.startswith("RESULT "):
            return json.loads(line.removeprefix("RESULT "))
    phases = [line.removeprefix("PHASE ") for line in lines if line.startswith("PHASE ")]
    phase = phases[-1] if phases else "start"
    status = PATCHED_ERROR if phase == "patched" else DOES_NOT_BUILD
    return {"file": file_name, "status": status, "calls": 0, "reason": f"{reason} ({phase})"}


def describe(record: dict) -> str:
    line = f"{record['file']}: {record['status']} (calls {record['calls']})"
    note = record["reason"] or record.get("left", "")
    return f"{line}: {note}" if note else line


def summary(records: list[dict]) -> str:
    statuses = collections.Counter(record["status"] for record in records)
    builds = len(records) - statuses[DOES_NOT_BUILD]
    return (f"engaged {statuses[ENGAGED]} of {builds} files that build; "
            f"mismatches {statuses[MISMATCH]}; patched errors {statuses[PATCHED_ERROR]}")


def parse_arguments(argv):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--files", help="comma-separated file names (default: every model file)")
    parser.add_argument("--jobs", type=int, default=2, help="subprocesses at a time")
    parser.add_argument("--json", type=pathlib.Path, help="write the records here")
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"))
    parser.add_argument("--timeout", type=float, default=120.0, help="seconds per file")
    parser.add_argument("--child", help=argparse.SUPPRESS)  # the file one subprocess runs
    return parser.parse_args(argv)


def main(argv) -> int:
    arguments = parse_arguments(argv)
    if arguments.child:
        record = census_of_file(arguments.child, getattr(mx, arguments.dtype))
        print("RESULT " + json.dumps(record), flush=True)
        return 0
    available = model_files()
    files = arguments.files.split(",") if arguments.files else available
    unknown = sorted(set(files) - set(available))
    if unknown:
        print(f"not model files of mlx_lm.models: {', '.join(unknown)}", file=sys.stderr)
        return 2
    census = functools.partial(
        run_in_subprocess, dtype_name=arguments.dtype, timeout=arguments.timeout
    )
    records = []
    with concurrent.futures.ThreadPoolExecutor(max_workers=arguments.jobs) as pool:
        for record in pool.map(census, files):
            print(describe(record), flush=True)
            records.append(record)
    print(summary(records))
    if arguments.json:
        arguments.json.write_text(json.dumps(records, indent=1) + "\n")
    return 1 if any(record["status"] in (MISMATCH, PATCHED_ERROR) for record in records) else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
