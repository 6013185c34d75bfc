"""A tiny model folder that mlx-lm's own commands load like a downloaded
checkpoint: config.json, weights mlx-lm builds and saves from that config
(``model.safetensors`` + index), and a word-level tokenizer written here
(tokenizer.json, tokenizer_config.json with a chat template). Nothing is
downloaded; the same seed gives the same weights."""

from __future__ import annotations

import json
import pathlib

import mlx.core as mx

SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "[UNK]")
END_OF_TEXT, _, END_OF_TURN, UNKNOWN = SPECIAL_TOKENS
# Roles first (the chat template writes them), then ordinary words and
# punctuation, enough for varied prompts and completions.
WORDS = (
    "system user assistant the a an of to in and is it that for on with as was "
    "he she they we you i his her their our my at by from this be are or not "
    "but have had has what all were when there can one do if will up out so "
    "about who get which go me more no like time just him know take people "
    "into year your good some could them see other than then now look only "
    "come its over think also back after use two how work first well way even "
    "new want because any these give day most us hello world cat dog sun moon "
    "red blue green river tree stone house road city song light dark cold warm"
).split() + [".", ",", "?", "!", ":"]
VOCABULARY = {token: index for index, token in enumerate((*SPECIAL_TOKENS, *WORDS))}

CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def qwen3_config(vocab_size: int = len(VOCABULARY)) -> dict:
    """A qwen3 config.json at toy size: 2 layers, 4 query and 2 key/value
    heads of 16 dimensions."""
    return {
        "model_type": "qwen3",
        "architectures": ["Qwen3ForCausalLM"],
        "hidden_size": 64,
        "num_hidden_layers": 2,
        "intermediate_size": 128,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "rms_norm_eps": 1e-6,
        "vocab_size": vocab_size,
        "max_position_embeddings": 4096,
        "rope_theta": 1_000_000.0,
        "tie_word_embeddings": True,
        "eos_token_id": VOCABULARY[END_OF_TURN],
        "torch_dtype": "float32",
    }


def _tokenizer_json() -> dict:
    added = [
        {
            "id": VOCABULARY[token], "content": token, "single_word": False, "lstrip": False,
            "rstrip": False, "normalized": False, "special": True,
        }
        for token in SPECIAL_TOKENS
    ]
    return {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": added,
        "normalizer": {"type": "Lowercase"},
        "pre_tokenizer": {"type": "Whitespace"},
        "post_processor": None,
        "decoder": None,
        "model": {"type": "WordLevel", "vocab": VOCABULARY, "unk_token": UNKNOWN},
    }


def _tokenizer_config() -> dict:
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "eos_token": END_OF_TURN,
        "pad_token": END_OF_TEXT,
        "unk_token": UNKNOWN,
        "bos_token": None,
        "add_bos_token": False,
        "model_max_length": 4096,
        "clean_up_tokenization_spaces": False,
        "chat_template": CHAT_TEMPLATE,
    }


# mlx-lm's initial weights at this size make a greedy decode repeat one
# word; scaled up (norm weights aside) it wanders over the vocabulary, so
# token-for-token comparisons compare many different tokens.
WEIGHT_SCALE = 6.0


def write_qwen3_model_folder(folder: pathlib.Path, *, seed: int = 8) -> pathlib.Path:
    """Writes the tiny qwen3 model folder into ``folder`` (created) and
    returns it. The weights are those of mlx-lm's own qwen3 ``Model`` built
    from the config under ``seed`` (times WEIGHT_SCALE), saved by mlx-lm's
    ``save_model``."""
    from mlx.utils import tree_map_with_path
    from mlx_lm.utils import _get_classes, save_config, save_model

    folder.mkdir(parents=True, exist_ok=True)
    config = qwen3_config()
    model_class, arguments_class = _get_classes(config)
    mx.random.seed(seed)
    model = model_class(arguments_class.from_dict(config))
    model.update(
        tree_map_with_path(
            lambda name, weight: weight if "norm" in name else weight * WEIGHT_SCALE,
            model.parameters(),
        )
    )
    mx.eval(model.parameters())
    save_model(folder, model)
    save_config(dict(config), folder / "config.json")
    (folder / "tokenizer.json").write_text(json.dumps(_tokenizer_json(), indent=1))
    (folder / "tokenizer_config.json").write_text(json.dumps(_tokenizer_config(), indent=1))
    return folder
