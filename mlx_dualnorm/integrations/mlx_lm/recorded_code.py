"""The recorded code: the fingerprint of every piece of mlx-lm's (and
MLX's) code a replacement restates, as the replacements were tested
against it (mlx-lm 0.32.2 on MLX 0.32.4), and the decoder layers whose
pieces are recorded as one spelling of a shared shape. A table only;
:mod:`.registry` says what proves a piece, :mod:`.fingerprints` how a
fingerprint is taken."""

from __future__ import annotations

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
    # The projections a decoder-layer replay computes (MLX's own).
    "mlx.nn.layers.linear.Linear.__call__": frozenset({"6fff58703d603eb5"}),
    "mlx.nn.layers.quantized.QuantizedLinear.__call__": frozenset({"e17ba4a7cbca3d54"}),
}

# The pre-norm decoder layers whose second half (the residual add, the
# post-attention norm, a SwiGLU MLP and the second residual add) is one
# compiled replay (.decoder_layer), and their MLP classes. Each layer's
# ``__call__`` is one of two spellings of the same four lines (``out = h +
# r; return out`` or ``return h + r``), each MLP's one of three spellings of
# ``down_proj(swiglu(gate_proj(x), up_proj(x)))``.
DECODER_LAYER_CODE = frozenset({"b61e377b88a3762a", "5c68aee2ca3ee6ff"})
SWIGLU_MLP_CODE = frozenset({"331563ceb095c46d", "8cd29f93f222df75", "0ac71e977df628a5"})
# (mlx-lm module, decoder layer class, its MLP class)
DECODER_LAYERS = tuple(
    (f"mlx_lm.models.{module}", layer, mlp) for module, layer, mlp in (
        ("Klear", "KlearDecoderLayer", "KlearMLP"),
        ("deepseek", "DeepseekDecoderLayer", "DeepseekMLP"),
        ("deepseek_v2", "DeepseekV2DecoderLayer", "DeepseekV2MLP"),
        ("deepseek_v3", "DeepseekV3DecoderLayer", "DeepseekV3MLP"),
        ("deepseek_v32", "DeepseekV32DecoderLayer", "DeepseekV32MLP"),
        ("dots1", "Dots1DecoderLayer", "Dots1MLP"),
        ("ernie4_5", "DecoderLayer", "MLP"),
        ("ernie4_5_moe", "Ernie4_5_DecoderLayer", "Ernie4_5_MLP"),
        ("glm4_moe", "DecoderLayer", "MLP"),
        ("glm4_moe_lite", "Glm4MoeLiteDecoderLayer", "Glm4MoeLiteMLP"),
        ("helium", "HeliumDecoderLayer", "HeliumMLP"),
        ("hunyuan_v1_dense", "TransformerBlock", "MLP"),
        ("internlm3", "TransformerBlock", "MLP"),
        ("laguna", "TransformerBlock", "MLP"),
        ("llama", "TransformerBlock", "MLP"),
        ("mimo", "TransformerBlock", "MLP"),
        ("mimo_v2_flash", "DecoderLayer", "MLP"),
        ("nanbeige", "TransformerBlock", "MLP"),
        ("qwen2", "TransformerBlock", "MLP"),
        ("qwen2_moe", "Qwen2MoeDecoderLayer", "MLP"),
        ("qwen3", "TransformerBlock", "MLP"),
        ("qwen3_moe", "Qwen3MoeDecoderLayer", "MLP"),
        ("seed_oss", "TransformerBlock", "MLP"),
        ("youtu_llm", "YoutuLLMDecoderLayer", "YoutuLLMMLP"),
    )
)
for _module, _layer, _mlp in DECODER_LAYERS:
    RECORDED_CODE[f"{_module}.{_layer}.__call__"] = DECODER_LAYER_CODE
    RECORDED_CODE[f"{_module}.{_mlp}.__call__"] = SWIGLU_MLP_CODE
