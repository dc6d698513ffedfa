"""Tiny GGUF files for tests, written with the `gguf` package's writer as llama.cpp's converter
lays them out: random weights in a chosen tensor type, the query/key rows of llama models
permuted for llama.cpp's rotary, and a tokenizer trained here (byte-level BPE or SentencePiece
BPE) in the metadata."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, trainers

CORPUS = (
    "The quick brown fox jumps over the lazy dog. It's 2024 and we've got 12345 apples!\n"
    "Ünïcödé text: café, naïve, 日本語のテキスト, emoji 🙂 and tabs\tand    spaces.\n"
    "def add(a, b):\n    return a + b  # numbers 3.14159 and 1e-5\n"
    "Hello world! hello World? HELLO, wörld... The end.\n"
) * 20
SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
TEXTS = [
    "Hello world",
    "The quick brown fox jumps over the lazy dog.",
    "It's 2024: 12345 apples, 3.14159 and 1e-5!",
    "café naïve 日本語のテキスト 🙂",
    "tabs\tand    spaces\n\nnew lines  \n",
    "def add(a, b):\n    return a + b",
    "<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n",
    "x<|im_end|>y",
    "MiXeD CaSe's and we'LL see",
    "",
]


def byte_level_vocab(vocab_size: int = 400) -> tuple[list[str], list[str]]:
    """(tokens by id, merges) of a byte-level BPE trained on `CORPUS`, the specials first."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator([CORPUS], trainer)
    state = tok.model.__getstate__()
    import json

    model = json.loads(state)
    vocab = model["vocab"]
    tokens = [t for t, _ in sorted(vocab.items(), key=lambda kv: kv[1])]
    merges = [m if isinstance(m, str) else " ".join(m) for m in model["merges"]]
    return tokens, merges


def sentencepiece_vocab(vocab_size: int = 400) -> tuple[list[str], list[float], list[int]]:
    """(tokens, scores, token types) of a SentencePiece-style BPE vocabulary: <unk>, <s>, </s>,
    the 256 byte tokens, then pieces learned on `CORPUS` (scored by merge order)."""
    tok = Tokenizer(models.BPE(unk_token="<unk>", byte_fallback=True))
    tok.normalizer = normalizers.Replace(" ", "▁")
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, show_progress=False)
    tok.train_from_iterator([CORPUS], trainer)
    import json

    learned = json.loads(tok.model.__getstate__())
    chars = [t for t, _ in sorted(learned["vocab"].items(), key=lambda kv: kv[1]) if len(t) == 1]
    merged = [
        a + b for a, b in (m.split(" ") if isinstance(m, str) else m for m in learned["merges"])
    ]
    specials = ["<unk>", "<s>", "</s>"]
    byte_tokens = [f"<0x{b:02X}>" for b in range(256)]
    pieces = []
    for piece in chars + merged:
        if piece not in pieces:
            pieces.append(piece)
    tokens = specials + byte_tokens + pieces
    scores = [0.0] * (3 + 256) + [-float(i) for i in range(len(pieces))]
    types = [2, 3, 3] + [6] * 256 + [1] * len(pieces)
    return tokens, scores, types


def permute(weight: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's converter's row order for a llama query/key projection."""
    rows = weight.shape[0]
    rest = weight.shape[1:]
    return weight.reshape(heads, 2, rows // heads // 2, *rest).swapaxes(1, 2).reshape(weight.shape)


def _quantize(array: np.ndarray, kind: str) -> tuple[np.ndarray, gguf.GGMLQuantizationType]:
    qtype = gguf.GGMLQuantizationType[kind]
    if kind == "F32":
        return array.astype(np.float32), qtype
    if kind == "F16":
        return array.astype(np.float16), qtype
    if kind in ("Q4_K", "Q6_K"):
        return _random_k_blocks(array.shape, kind), qtype
    return gguf.quants.quantize(array.astype(np.float32), qtype), qtype


def _random_k_blocks(shape: tuple[int, ...], kind: str) -> np.ndarray:
    """Random K-quant blocks with small, finite scales (the gguf package cannot quantize
    them); what they hold is whatever they dequantize to."""
    qtype = gguf.GGMLQuantizationType[kind]
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    rows, cols = shape
    rng = np.random.default_rng(cols + rows)
    data = rng.integers(0, 256, size=(rows, cols // block, size), dtype=np.uint8)
    scale = np.full((rows, cols // block, 1), 0.002, np.float16).view(np.uint8)
    if kind == "Q4_K":  # d, dmin first
        data[..., 0:2] = scale
        data[..., 2:4] = scale
    else:  # Q6_K: d last
        data[..., -2:] = scale
    return data.reshape(rows, -1)


def write_gguf(
    path: Path,
    *,
    arch: str = "llama",
    kind: str = "F32",
    hidden: int = 64,
    layers: int = 2,
    heads: int = 4,
    kv_heads: int = 2,
    intermediate: int = 128,
    tied: bool = False,
    tokenizer: str = "gpt2",
    pre: str = "llama-bpe",
    seed: int = 0,
    head_dim: int | None = None,
    metadata: dict | None = None,
) -> Path:
    """Write a tiny `arch` GGUF file with its 2-D weights in `kind` (norms in F32)."""
    rng = np.random.default_rng(seed)
    writer = gguf.GGUFWriter(str(path), arch)
    if tokenizer == "gpt2":
        tokens, merges = byte_level_vocab()
        writer.add_tokenizer_model("gpt2")
        writer.add_tokenizer_pre(pre)
        writer.add_token_list(tokens)
        writer.add_token_merges(merges)
        writer.add_token_types([3 if t in SPECIAL else 1 for t in tokens])
        writer.add_bos_token_id(tokens.index("<|im_start|>"))
        writer.add_eos_token_id(tokens.index("<|im_end|>"))
        writer.add_add_bos_token(False)
        writer.add_chat_template(CHAT_TEMPLATE)
    else:
        tokens, scores, types = sentencepiece_vocab()
        writer.add_tokenizer_model("llama")
        writer.add_token_list(tokens)
        writer.add_token_scores(scores)
        writer.add_token_types(types)
        writer.add_bos_token_id(1)
        writer.add_eos_token_id(2)
        writer.add_unk_token_id(0)
    vocab = len(tokens)
    head_dim = head_dim or hidden // heads
    writer.add_context_length(256)
    writer.add_embedding_length(hidden)
    writer.add_block_count(layers)
    writer.add_feed_forward_length(intermediate)
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_layer_norm_rms_eps(1e-6)
    writer.add_rope_freq_base(10000.0)
    writer.add_vocab_size(vocab)
    if arch == "qwen3":
        writer.add_key_length(head_dim)
        writer.add_value_length(head_dim)
    for key, value in (metadata or {}).items():
        writer.add_key_value(key, *value)

    def weight(name, rows, cols, scale=0.2, permute_heads=None):
        w = rng.normal(0, scale, size=(rows, cols)).astype(np.float32)
        if permute_heads:
            w = permute(w, permute_heads)
        data, qtype = _quantize(w, kind)
        writer.add_tensor(name, data, raw_dtype=qtype)

    def vector(name, size, base=1.0):
        writer.add_tensor(name, (base + rng.normal(0, 0.1, size=size)).astype(np.float32))

    permuted = arch == "llama"
    weight("token_embd.weight", vocab, hidden, scale=1.0)
    for i in range(layers):
        b = f"blk.{i}."
        vector(b + "attn_norm.weight", hidden)
        weight(
            b + "attn_q.weight", heads * head_dim, hidden, permute_heads=heads if permuted else None
        )
        weight(
            b + "attn_k.weight",
            kv_heads * head_dim,
            hidden,
            permute_heads=kv_heads if permuted else None,
        )
        weight(b + "attn_v.weight", kv_heads * head_dim, hidden)
        weight(b + "attn_output.weight", hidden, heads * head_dim)
        if arch == "qwen2":
            for proj, size in (
                ("q", heads * head_dim),
                ("k", kv_heads * head_dim),
                ("v", kv_heads * head_dim),
            ):
                vector(b + f"attn_{proj}.bias", size, base=0.0)
        if arch == "qwen3":
            vector(b + "attn_q_norm.weight", head_dim)
            vector(b + "attn_k_norm.weight", head_dim)
        vector(b + "ffn_norm.weight", hidden)
        weight(b + "ffn_gate.weight", intermediate, hidden)
        weight(b + "ffn_up.weight", intermediate, hidden)
        weight(b + "ffn_down.weight", hidden, intermediate)
    vector("output_norm.weight", hidden)
    if not tied:
        weight("output.weight", vocab, hidden)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
