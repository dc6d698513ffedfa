"""Tiny random checkpoints for tests: config.json + model.safetensors + a `tokenizers` tokenizer.

Weights are drawn at a large scale so next-token distributions are peaked: greedy argmax then
has no near-ties that a batched pass could flip.
"""

from __future__ import annotations

import json
from pathlib import Path

import mlx_spec  # noqa: F401  (loads the BLAS before mlx)

import mlx.core as mx
from mlx.utils import tree_flatten, tree_map
from mlx_lm.utils import _get_classes
from tokenizers import Tokenizer, decoders, models, pre_tokenizers

ALPHABET = "abcdefghijklmnop \n"
SPECIALS = ["<unk>", "<s>", "</s>"]
BOS_ID, EOS_ID = 1, 2


def build_tokenizer(alphabet: str = ALPHABET) -> Tokenizer:
    """Character-level tokenizer: 3 specials then one id per character."""
    vocab = {tok: i for i, tok in enumerate(SPECIALS + list(alphabet))}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split("", behavior="isolated")
    tok.decoder = decoders.Fuse()
    tok.add_special_tokens(SPECIALS)
    return tok


def tokenizer_size(alphabet: str = ALPHABET) -> int:
    return len(SPECIALS) + len(alphabet)


def llama_config(vocab_size: int, **overrides) -> dict:
    config = {
        "model_type": "llama",
        "hidden_size": 32,
        "num_hidden_layers": 2,
        "intermediate_size": 64,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "rms_norm_eps": 1e-5,
        "vocab_size": vocab_size,
        "max_position_embeddings": 512,
        "rope_theta": 10000.0,
        "tie_word_embeddings": False,
        "bos_token_id": BOS_ID,
        "eos_token_id": EOS_ID,
    }
    config.update(overrides)
    return config


def gemma3_config(vocab_size: int, sliding_window: int = 8, **overrides) -> dict:
    config = {
        "model_type": "gemma3_text",
        "hidden_size": 32,
        "num_hidden_layers": 3,
        "intermediate_size": 64,
        "num_attention_heads": 2,
        "num_key_value_heads": 1,
        "head_dim": 16,
        "query_pre_attn_scalar": 16,
        "rms_norm_eps": 1e-6,
        "vocab_size": vocab_size,
        "max_position_embeddings": 512,
        "sliding_window": sliding_window,
        "sliding_window_pattern": 3,
        "bos_token_id": BOS_ID,
        "eos_token_id": EOS_ID,
    }
    config.update(overrides)
    return config


def qwen3_5_config(vocab_size: int, **overrides) -> dict:
    """A hybrid target: gated delta-net layers (ArraysCache) plus one full-attention layer."""
    config = {
        "model_type": "qwen3_5",
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_hidden_layers": 4,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 8,
        "linear_num_value_heads": 4,
        "linear_num_key_heads": 2,
        "linear_key_head_dim": 8,
        "linear_value_head_dim": 8,
        "linear_conv_kernel_dim": 4,
        "full_attention_interval": 2,
        "vocab_size": vocab_size,
        "max_position_embeddings": 512,
        "rms_norm_eps": 1e-6,
        "tie_word_embeddings": False,
        "bos_token_id": BOS_ID,
        "eos_token_id": EOS_ID,
    }
    config.update(overrides)
    return config


def random_weights(config: dict, seed: int, scale: float = 1.0) -> dict[str, mx.array]:
    """Random parameters for the mlx-lm model of `config`, in mlx-lm's own naming."""
    model_cls, args_cls = _get_classes(config)
    model = model_cls(args_cls.from_dict(config))
    mx.random.seed(seed)
    params = tree_map(
        lambda p: (
            mx.random.normal(p.shape) * scale * (p.shape[-1] ** -0.5) * 2.0
            if p.ndim >= 2
            else 1.0 + 0.1 * mx.random.normal(p.shape)
        ),
        model.parameters(),
    )
    return dict(tree_flatten(params))


def perturb(weights: dict[str, mx.array], noise: float, seed: int) -> dict[str, mx.array]:
    """A near-copy of `weights`: a draft model that agrees with the target most of the time."""
    mx.random.seed(seed)
    return {k: v + noise * v.std() * mx.random.normal(v.shape) for k, v in weights.items()}


def write_checkpoint(
    path: Path, config: dict, weights: dict[str, mx.array], tokenizer: Tokenizer | None = None
) -> Path:
    """Write a model directory that mlx_lm.load / mlx_spec.load open."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(config, indent=2))
    mx.save_safetensors(str(path / "model.safetensors"), weights)
    write_tokenizer(path, tokenizer)
    return path


def write_tokenizer(path: Path, tokenizer: Tokenizer | None = None) -> None:
    """tokenizer.json + a tokenizer_config.json that transformers and mlx-lm open."""
    (tokenizer or build_tokenizer()).save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "tokenizer_class": "PreTrainedTokenizerFast",
                "bos_token": "<s>",
                "eos_token": "</s>",
                "unk_token": "<unk>",
                "add_bos_token": False,
            }
        )
    )


# ------------------------------------------------------------------ a model that calls tools

TOOL_ALPHABET = "abcdefghijklmnopqrstuvwxyz :\n"
TOOL_TOKENS = ["<|system|>", "<|user|>", "<|assistant|>", "<|tool|>", "<tool_call>", "</tool_call>"]
TOOL_EOS = "<|end|>"
TOOL_CALL_TEXT = '{"name": "get_weather", "arguments": {"city": "Paris"}}'
TOOL_REPLY = "done"  # the answer once a tool result is in the history

# The chat template: tools listed in a system turn, earlier calls rendered back, and a tool
# result followed by "<|assistant|>\n" (the model answers "done" after a newline, and calls
# get_weather after a bare "<|assistant|>"). mlx-lm picks its json_tools parser from it.
TOOL_TEMPLATE = (
    "{%- if tools %}<|system|>tools:{% for t in tools %} {{ t.function.name }}{% endfor %}"
    "<|end|>{% endif -%}"
    "{%- for m in messages -%}"
    "{%- if m.role == 'assistant' and m.tool_calls -%}<|assistant|>"
    "{%- for c in m.tool_calls %}{% set tool_call = c.function %}<tool_call>"
    '{"name": "{{ tool_call.name }}", "arguments": {{ tool_call.arguments | tojson }}}'
    "</tool_call>{% endfor %}<|end|>"
    "{%- else -%}<|{{ m.role }}|>{{ m.content }}<|end|>{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}<|assistant|>"
    "{%- if messages[-1].role == 'tool' %}{{ '\\n' }}{% endif -%}{%- endif -%}"
)


def write_tool_checkpoint(path: Path) -> Path:
    """A llama checkpoint that answers as a lookup table on its last token (attention and MLP
    outputs are zero, the head maps each token to its successor): after "<|assistant|>" it
    emits `<tool_call>` + TOOL_CALL_TEXT + `</tool_call>` + EOS; after a newline, TOOL_REPLY +
    EOS. Its tokenizer's chat template supports tools."""
    specials = SPECIALS + [TOOL_EOS]
    vocab = {tok: i for i, tok in enumerate(specials + list(TOOL_ALPHABET))}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split("", behavior="isolated")
    tok.decoder = decoders.Fuse()
    tok.add_special_tokens(specials)
    tok.add_tokens(TOOL_TOKENS + [TOOL_CALL_TEXT])
    ids = tok.get_vocab()
    size = len(ids)
    config = llama_config(size, hidden_size=64, eos_token_id=ids[TOOL_EOS])
    chain = ["<|assistant|>", "<tool_call>", TOOL_CALL_TEXT, "</tool_call>", TOOL_EOS]
    chain2 = ["\n", *TOOL_REPLY, TOOL_EOS]
    successor = {i: ids["a"] for i in range(size)}
    for seq in (chain, chain2):
        for a, b in zip(seq[:-1], seq[1:], strict=True):
            successor[ids[a]] = ids[b]
    return write_lookup_checkpoint(path, config, tok, successor, TOOL_TEMPLATE)


def write_lookup_checkpoint(path: Path, config: dict, tok: Tokenizer, successor: dict, template):
    """A llama checkpoint whose next token is `successor[last token]` (attention and MLP
    outputs are zero, the head maps each token to its successor), with `tok` and the chat
    `template` (EOS: "<|end|>")."""
    size = config["vocab_size"]
    weights = random_weights(config, seed=7)
    hidden = config["hidden_size"]
    weights["model.embed_tokens.weight"] = mx.eye(size, hidden)
    head = mx.zeros((size, hidden))
    rows = mx.array(list(successor.values()))
    cols = mx.array(list(successor.keys()))
    head[rows, cols] = 2.0
    weights["lm_head.weight"] = head
    for name in list(weights):
        if name.endswith(("o_proj.weight", "down_proj.weight")):
            weights[name] = mx.zeros_like(weights[name])
        elif name.endswith("norm.weight"):
            weights[name] = mx.ones_like(weights[name])
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(config, indent=2))
    mx.save_safetensors(str(path / "model.safetensors"), weights)
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "tokenizer_class": "PreTrainedTokenizerFast",
                "bos_token": "<s>",
                "eos_token": TOOL_EOS,
                "unk_token": "<unk>",
                "add_bos_token": False,
                "chat_template": template,
            }
        )
    )
    return path


SCRIPT_TEMPLATE = (
    "{%- for m in messages -%}<|{{ m.role }}|>{{ m.content }}<|end|>{%- endfor -%}"
    "{%- if add_generation_prompt -%}<|assistant|>{%- endif -%}"
)


def write_script_checkpoint(path: Path, pieces: list[str], context: int = 8192) -> Path:
    """A lookup-table llama with a chat template that, after "<|assistant|>", writes `pieces`
    (each its own token, all different) over and over, never ending."""
    specials = SPECIALS + [TOOL_EOS]
    vocab = {tok: i for i, tok in enumerate(specials + list(TOOL_ALPHABET))}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split("", behavior="isolated")
    tok.decoder = decoders.Fuse()
    tok.add_special_tokens(specials)
    tok.add_tokens(["<|system|>", "<|user|>", "<|assistant|>", *pieces])
    ids = tok.get_vocab()
    config = llama_config(
        len(ids), hidden_size=64, eos_token_id=ids[TOOL_EOS], max_position_embeddings=context
    )
    successor = {i: ids["a"] for i in range(len(ids))}
    chain = ["<|assistant|>", *pieces, pieces[0]]
    for a, b in zip(chain[:-1], chain[1:], strict=True):
        successor[ids[a]] = ids[b]
    return write_lookup_checkpoint(path, config, tok, successor, SCRIPT_TEMPLATE)
