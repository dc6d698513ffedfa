"""The tokenizer a GGUF file describes, rebuilt as a `tokenizer.json` (+ `tokenizer_config.json`
with the special tokens, BOS/EOS behaviour and chat template) that mlx-lm's tokenizer loads.

Two kinds are rebuilt, as llama.cpp tokenizes them:
- "gpt2": byte-level BPE; the text is split first by the regular expressions of the file's
  pre-tokenizer name (`tokenizer.ggml.pre`), the ones llama.cpp uses for that name.
- "llama": SentencePiece BPE with byte fallback; merges from the file or, when it has none,
  recovered from the scores; a space is put before the text and after every special token,
  as llama.cpp (and the original Llama tokenizers) do.
Tokens of type CONTROL become special added tokens, USER_DEFINED ones plain added tokens.
"""

from __future__ import annotations

import json
from pathlib import Path

from convert.errors import ConversionError

CONTROL, USER_DEFINED = 3, 4

# The GPT-2 split: contractions, letters, digits, other symbols, spaces.
_GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
_LLAMA3 = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2 = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN35 = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}"
    r"| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_TEKKEN = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
    r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_GPT4O = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# tokenizer.ggml.pre -> (splits applied in turn, whether whole words skip the merges)
PRE_TOKENIZERS: dict[str, tuple[tuple[str, ...], bool]] = {
    **dict.fromkeys(("gpt-2", "gpt2", "phi-2", "mpt", "olmo", "jais"), ((_GPT2,), False)),
    "default": ((r"[\p{P}\$\+<=>\^~\|]+", _GPT2, r"\p{N}+", r"[0-9][0-9][0-9]"), False),
    **dict.fromkeys(
        ("smollm", "starcoder", "refact", "command-r", "codeshell", "exaone", "minerva-7b"),
        ((r"\p{N}", _GPT2), False),
    ),
    **dict.fromkeys(
        ("llama3", "llama-v3", "llama-bpe", "falcon3", "pixtral", "lfm2", "dbrx", "smaug-bpe"),
        ((_LLAMA3,), True),
    ),
    **dict.fromkeys(
        ("qwen2", "deepseek-r1-qwen", "stablelm2", "megrez", "hunyuan"), ((_QWEN2,), False)
    ),
    "qwen35": ((_QWEN35,), False),
    "tekken": ((_TEKKEN,), True),
    **dict.fromkeys(("gpt-4o", "llama4"), ((_GPT4O,), True)),
}


def _byte_alphabet() -> dict[int, str]:
    """GPT-2's printable spelling of each byte (the alphabet byte-level vocabularies use)."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1)]
    keep += list(range(ord("®"), ord("ÿ") + 1))
    spelling, extra = {}, 0
    for byte in range(256):
        if byte in keep:
            spelling[byte] = chr(byte)
        else:
            spelling[byte] = chr(256 + extra)
            extra += 1
    return spelling


def _field(metadata: dict, key: str, default=None):
    value = metadata.get(f"tokenizer.ggml.{key}", default)
    return value.item() if hasattr(value, "item") else value


def build_tokenizer(metadata: dict):
    """(tokenizers.Tokenizer, tokenizer_config dict) of a GGUF file's tokenizer metadata."""
    kind = _field(metadata, "model")
    tokens = list(metadata.get("tokenizer.ggml.tokens") or [])
    if not tokens:
        raise ConversionError("the GGUF file has no tokenizer (tokenizer.ggml.tokens)")
    types = [int(t) for t in metadata.get("tokenizer.ggml.token_type", [1] * len(tokens))]
    if len(types) != len(tokens):
        raise ConversionError(f"tokenizer: {len(types)} token types for {len(tokens)} tokens")
    if kind == "gpt2":
        tokenizer, add_bos_default = _byte_level(metadata, tokens, types), False
    elif kind == "llama":
        tokenizer, add_bos_default = _sentencepiece(metadata, tokens, types), True
    else:
        raise ConversionError(f"tokenizer kind {kind!r} is not rebuilt (taken: gpt2, llama)")
    config = _tokenizer_config(metadata, tokens, add_bos_default)
    _post_processor(tokenizer, config, tokens, metadata)
    return tokenizer, config


def _added_tokens(tokenizer, tokens: list[str], types: list[int], spelled: set | None) -> None:
    """Control tokens as special added tokens, user-defined ones as plain added tokens (both
    matched whole in the text); a byte-level one spelled outside the byte alphabet is not a
    token the vocabulary can hold and is left out (llama.cpp mislabels some)."""
    from tokenizers import AddedToken

    vocab = tokenizer.get_vocab()
    special, plain = [], []
    for token, kind in zip(tokens, types, strict=True):
        if kind == CONTROL and (spelled is None or set(token) <= spelled):
            special.append(AddedToken(token, normalized=False, special=True))
        elif kind == USER_DEFINED and token in vocab:
            plain.append(AddedToken(token, normalized=False, special=False))
    tokenizer.add_special_tokens(special)
    tokenizer.add_tokens(plain)


def _vocab(tokens: list[str]) -> dict[str, int]:
    vocab: dict[str, int] = {}
    for index, token in enumerate(tokens):
        vocab.setdefault(token, index)  # a repeated spelling keeps its first id, as llama.cpp
    return vocab


def _byte_level(metadata: dict, tokens: list[str], types: list[int]):
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers

    pre = _field(metadata, "pre", "default")
    if pre not in PRE_TOKENIZERS:
        raise ConversionError(
            f"tokenizer pre-tokenizer {pre!r} is not known "
            f"(known: {', '.join(sorted(PRE_TOKENIZERS))})"
        )
    splits, ignore_merges = PRE_TOKENIZERS[pre]
    alphabet = _byte_alphabet()
    spelled = set(alphabet.values())
    # tokens stored as raw text (some added ones) are spelled in the byte alphabet
    tokens = [
        t if set(t) <= spelled else "".join(alphabet[b] for b in t.encode("utf-8")) for t in tokens
    ]
    merges = [_merge(m) for m in metadata.get("tokenizer.ggml.merges") or []]
    model = models.BPE(vocab=_vocab(tokens), merges=merges, ignore_merges=ignore_merges)
    tokenizer = Tokenizer(model)
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Split(Regex(s), behavior="isolated") for s in splits]
        + [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]
    )
    tokenizer.decoder = decoders.ByteLevel()
    _added_tokens(tokenizer, tokens, types, spelled)
    return tokenizer


def _merge(text: str) -> tuple[str, str]:
    parts = text.split(" ")
    if len(parts) != 2:
        raise ConversionError(f"tokenizer: merge {text!r} is not two tokens")
    return parts[0], parts[1]


def _sentencepiece(metadata: dict, tokens: list[str], types: list[int]):
    from tokenizers import Tokenizer, decoders, models, normalizers

    vocab = _vocab(tokens)
    if metadata.get("tokenizer.ggml.merges"):
        merges = [_merge(m) for m in metadata["tokenizer.ggml.merges"]]
    else:
        scores = [float(s) for s in metadata.get("tokenizer.ggml.scores", [])]
        if len(scores) != len(tokens):
            raise ConversionError("tokenizer: a SentencePiece vocabulary without scores or merges")
        merges = merges_from_scores(tokens, scores)
    unk = _field(metadata, "unknown_token_id", 0)
    model = models.BPE(
        vocab=vocab, merges=merges, unk_token=tokens[unk], fuse_unk=True, byte_fallback=True
    )
    tokenizer = Tokenizer(model)
    steps = [normalizers.Replace(" ", "▁")]
    prefix = bool(_field(metadata, "add_space_prefix", True))
    if prefix:
        steps.insert(0, normalizers.Prepend("▁"))
    tokenizer.normalizer = normalizers.Sequence(steps)
    decoding = [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
    if prefix:
        decoding.append(decoders.Strip(content=" ", left=1))
    tokenizer.decoder = decoders.Sequence(decoding)
    _added_tokens(tokenizer, tokens, types, None)
    return tokenizer


def merges_from_scores(tokens: list[str], scores: list[float]) -> list[tuple[str, str]]:
    """The merges a SentencePiece BPE vocabulary implies: every split of a token into two
    tokens, best-scored token first (ties: lower ids of the parts first)."""
    vocab = _vocab(tokens)
    found = []
    for piece, score in zip(tokens, scores, strict=True):
        pairs = [
            (vocab[piece[:i]], vocab[piece[i:]], piece[:i], piece[i:])
            for i in range(1, len(piece))
            if piece[:i] in vocab and piece[i:] in vocab
        ]
        for left_id, right_id, left, right in sorted(pairs):
            found.append((-score, vocab[piece], left_id, right_id, left, right))
    found.sort(key=lambda f: (f[0], f[1], f[2], f[3]))
    return [(left, right) for *_, left, right in found]


def _tokenizer_config(metadata: dict, tokens: list[str], add_bos_default: bool) -> dict:
    def token(key):
        index = _field(metadata, f"{key}_token_id")
        return tokens[index] if index is not None and 0 <= index < len(tokens) else None

    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": token("bos"),
        "eos_token": token("eos"),
        "unk_token": token("unknown"),
        "pad_token": token("padding"),
        "add_bos_token": bool(_field(metadata, "add_bos_token", add_bos_default)),
        "add_eos_token": bool(_field(metadata, "add_eos_token", False)),
        "clean_up_tokenization_spaces": False,
    }
    template = metadata.get("tokenizer.chat_template")
    if template:
        config["chat_template"] = str(template)
    return {k: v for k, v in config.items() if v is not None}


def _post_processor(tokenizer, config: dict, tokens: list[str], metadata: dict) -> None:
    """BOS and EOS added around an encoded text as the file asks (add_bos_token/add_eos_token)."""
    from tokenizers import processors

    bos = _field(metadata, "bos_token_id")
    eos = _field(metadata, "eos_token_id")
    head = [(tokens[bos], bos)] if config["add_bos_token"] and bos is not None else []
    tail = [(tokens[eos], eos)] if config["add_eos_token"] and eos is not None else []
    if not head and not tail:
        return
    single = " ".join([f"{t}:0" for t, _ in head] + ["$A:0"] + [f"{t}:0" for t, _ in tail])
    pair = (
        single
        + " "
        + " ".join([f"{t}:1" for t, _ in head] + ["$B:1"] + [f"{t}:1" for t, _ in tail])
    )
    tokenizer.post_processor = processors.TemplateProcessing(
        single=single, pair=pair, special_tokens=sorted(set(head + tail), key=lambda x: x[1])
    )


def write_tokenizer(file, out: Path) -> dict:
    """Write tokenizer.json and tokenizer_config.json for GGUF `file` into `out`; returns a
    summary for conversion.json."""
    tokenizer, config = build_tokenizer(file.metadata)
    tokenizer.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2, ensure_ascii=False))
    return {
        "kind": _field(file.metadata, "model"),
        "pre": _field(file.metadata, "pre"),
        "tokens": len(file.metadata.get("tokenizer.ggml.tokens") or []),
        "add_bos_token": config["add_bos_token"],
        "chat_template": "chat_template" in config,
    }
