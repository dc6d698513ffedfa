"""Gemma 4 assistant drafter (HF `model_type: gemma4_assistant`), ported to MLX.

T = target hidden size (`backbone_hidden_size`), d = assistant hidden size. One call:

    x = pre_projection(inputs_embeds)                  # [B, L, 2T] -> [B, L, d]
    each layer: Q-only attention over the TARGET's K/V (one (K, V) pair per layer type),
        q = RoPE(q_norm(q_proj(input_layernorm(x)))), attention scale 1.0,
        x = x + post_attention_layernorm(o_proj(attn))
        x = x + post_feedforward_layernorm(mlp(pre_feedforward_layernorm(x)))
        x = x * layer_scalar
    z = norm(x); logits = head(z); projected = post_projection(z)   # [d] -> [T]

The head is the tied embedding, or the centroid "masked embedding" when
`use_ordered_embeddings`: score the centroids, keep the top k, compute logits only for their
tokens and fill every other token with min(selected) - 1. Norms are Gemma 4's `x * w`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from mlx_spec.platform import weight_layout

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

LAYER_TYPES = ("sliding_attention", "full_attention")
ACTIVATIONS = {"gelu_pytorch_tanh": nn.gelu_approx, "gelu": nn.gelu}
# Tensors transformers itself ignores in KV-shared layers (the assistant has no K/V of its own).
IGNORED_SUFFIXES = tuple(f".self_attn.{n}.weight" for n in ("k_proj", "v_proj", "k_norm", "v_norm"))


@dataclass(frozen=True)
class AssistantArgs:
    """The settings the forward pass needs, read from an HF `gemma4_assistant` config."""

    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    head_dims: tuple[int, ...]  # per layer: sliding layers head_dim, full ones global_head_dim
    layer_types: tuple[str, ...]
    sliding_window: int
    rms_norm_eps: float
    vocab_size: int
    rope_parameters: dict
    hidden_activation: str
    backbone_hidden_size: int
    tie_word_embeddings: bool
    use_ordered_embeddings: bool
    num_centroids: int
    centroid_top_k: int

    @classmethod
    def from_config(cls, config: dict, where: str = "config") -> AssistantArgs:
        """Validate an HF assistant config.json (as a dict) and keep what the port uses."""
        if config.get("model_type") != "gemma4_assistant":
            got = config.get("model_type")
            raise ValueError(f"{where}: model_type is {got!r}, expected 'gemma4_assistant'")
        text = config.get("text_config") or {}
        _check_text_config(text, where)
        types = tuple(text["layer_types"])
        window = text.get("sliding_window", 512)
        if text.get("use_bidirectional_attention") == "all":
            window = window // 2 + 1  # transformers' own conversion for this setting
        return cls(
            hidden_size=text["hidden_size"],
            intermediate_size=text["intermediate_size"],
            num_attention_heads=text["num_attention_heads"],
            head_dims=_head_dims(text, types),
            layer_types=types,
            sliding_window=window,
            rms_norm_eps=text.get("rms_norm_eps", 1e-6),
            vocab_size=text["vocab_size"],
            rope_parameters=text.get("rope_parameters") or _DEFAULT_ROPE,
            hidden_activation=text.get("hidden_activation", "gelu_pytorch_tanh"),
            backbone_hidden_size=config.get("backbone_hidden_size", 1536),
            tie_word_embeddings=config.get("tie_word_embeddings", True),
            use_ordered_embeddings=bool(config.get("use_ordered_embeddings", False)),
            num_centroids=config.get("num_centroids", 2048),
            centroid_top_k=config.get("centroid_intermediate_top_k", 32),
        )

    def head_dim_of(self, layer_type: str) -> int:
        """Head dim of the layers of `layer_type` (the target's K/V must have it)."""
        pairs = zip(self.head_dims, self.layer_types, strict=True)
        return next(d for d, t in pairs if t == layer_type)


_DEFAULT_ROPE = {  # transformers' Gemma4TextConfig defaults
    "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
    "full_attention": {
        "rope_type": "proportional",
        "partial_rotary_factor": 0.25,
        "rope_theta": 1_000_000.0,
    },
}

# Settings the assistant architecture fixes (transformers' Gemma4AssistantConfig checks them).
_REQUIRED = {
    "hidden_size_per_layer_input": (0, None),
    "enable_moe_block": (False, None),
    "use_double_wide_mlp": (False, None),
    "attention_bias": (False, None),
}


def _check_text_config(text: dict, where: str) -> None:
    if text.get("model_type", "gemma4_text") != "gemma4_text":
        raise ValueError(f"{where}: text_config model_type must be 'gemma4_text'")
    for key, allowed in _REQUIRED.items():
        if text.get(key) not in allowed:
            raise ValueError(f"{where}: text_config.{key}={text.get(key)!r} is not supported")
    types = text.get("layer_types")
    if not types or any(t not in LAYER_TYPES for t in types):
        raise ValueError(f"{where}: text_config.layer_types must list {' / '.join(LAYER_TYPES)}")
    if text.get("hidden_activation", "gelu_pytorch_tanh") not in ACTIVATIONS:
        raise ValueError(f"{where}: unsupported hidden_activation {text['hidden_activation']!r}")


def _head_dims(text: dict, types: tuple[str, ...]) -> tuple[int, ...]:
    """Per-layer head dims: `per_layer_config` when saved, else transformers' defaults
    (full-attention layers take `global_head_dim`, 512 when absent)."""
    overrides = text.get("per_layer_config")
    dims = []
    for i, kind in enumerate(types):
        if overrides is not None:
            dims.append((overrides.get(str(i)) or {}).get("head_dim", text["head_dim"]))
        elif kind == "full_attention":
            dims.append(text.get("global_head_dim", 512))
        else:
            dims.append(text.get("head_dim", 256))
    return tuple(dims)


def rope_inv_freq(params: dict, head_dim: int) -> mx.array:
    """`[head_dim / 2]` inverse frequencies; "proportional" rotates only the first
    `partial_rotary_factor` of the pairs (zero frequency leaves the rest unrotated)."""
    kind, base = params.get("rope_type", "default"), params["rope_theta"]
    if kind == "default":
        return 1.0 / base ** (mx.arange(0, head_dim, 2, dtype=mx.float32) / head_dim)
    if kind != "proportional":
        raise ValueError(f"unsupported rope_type {kind!r} (supported: default, proportional)")
    angles = int(params.get("partial_rotary_factor", 1.0) * head_dim // 2)
    rotated = 1.0 / base ** (mx.arange(0, 2 * angles, 2, dtype=mx.float32) / head_dim)
    inv_freq = mx.concatenate([rotated, mx.zeros((head_dim // 2 - angles,), mx.float32)])
    return inv_freq / params.get("factor", 1.0)


def apply_rope(x: mx.array, positions: mx.array, inv_freq: mx.array) -> mx.array:
    """Rotate-half RoPE of `x` `[B, H, L, D]` at explicit `positions` `[B, L]` (they may repeat:
    the assistant keeps one position for a whole round)."""
    freqs = positions[..., None].astype(mx.float32) * inv_freq  # [B, L, D/2]
    emb = mx.concatenate([freqs, freqs], axis=-1)[:, None]  # [B, 1, L, D]
    cos, sin = mx.cos(emb).astype(x.dtype), mx.sin(emb).astype(x.dtype)
    half = x.shape[-1] // 2
    rotated = mx.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    return x * cos + rotated * sin


def sliding_mask(q_len: int, kv_len: int, window: int) -> mx.array | None:
    """`[L, S]` bool: query i sees entry j when |i - (S - 1 - j)| <= window (transformers'
    bidirectional window flipped to look back from the newest entry); None if all visible."""
    if max(q_len, kv_len) - 1 <= window:
        return None
    back = kv_len - 1 - mx.arange(kv_len)  # [S] distance of entry j from the newest
    return mx.abs(mx.arange(q_len)[:, None] - back[None]) <= window  # [L, S]


class Attention(nn.Module):
    """Query-only attention over K/V that the target computed (no k/v projections)."""

    def __init__(self, args: AssistantArgs, head_dim: int, inv_freq: mx.array):
        super().__init__()
        self.n_heads, self.head_dim = args.num_attention_heads, head_dim
        self.q_proj = nn.Linear(args.hidden_size, self.n_heads * head_dim, bias=False)
        self.q_norm = nn.RMSNorm(head_dim, eps=args.rms_norm_eps)
        self.o_proj = nn.Linear(self.n_heads * head_dim, args.hidden_size, bias=False)
        object.__setattr__(self, "_inv_freq", inv_freq)  # a constant, not a parameter

    def __call__(self, x: mx.array, positions: mx.array, kv: tuple, mask) -> mx.array:
        B, L, _ = x.shape
        q = self.q_norm(self.q_proj(x).reshape(B, L, self.n_heads, self.head_dim))
        q = apply_rope(q.transpose(0, 2, 1, 3), positions, self._inv_freq)  # [B, H, L, D]
        keys, values = kv  # [B, kv_heads, S, D]
        out = mx.fast.scaled_dot_product_attention(q, keys, values, scale=1.0, mask=mask)
        return self.o_proj(out.transpose(0, 2, 1, 3).reshape(B, L, -1))


class MLP(nn.Module):
    def __init__(self, args: AssistantArgs):
        super().__init__()
        self.gate_proj = nn.Linear(args.hidden_size, args.intermediate_size, bias=False)
        self.up_proj = nn.Linear(args.hidden_size, args.intermediate_size, bias=False)
        self.down_proj = nn.Linear(args.intermediate_size, args.hidden_size, bias=False)
        object.__setattr__(self, "_act", ACTIVATIONS[args.hidden_activation])

    def __call__(self, x: mx.array) -> mx.array:
        return self.down_proj(self._act(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, args: AssistantArgs, index: int, inv_freq: mx.array):
        super().__init__()
        d, eps = args.hidden_size, args.rms_norm_eps
        self.layer_type = args.layer_types[index]
        self.self_attn = Attention(args, args.head_dims[index], inv_freq)
        self.mlp = MLP(args)
        self.input_layernorm = nn.RMSNorm(d, eps=eps)
        self.post_attention_layernorm = nn.RMSNorm(d, eps=eps)
        self.pre_feedforward_layernorm = nn.RMSNorm(d, eps=eps)
        self.post_feedforward_layernorm = nn.RMSNorm(d, eps=eps)
        self.layer_scalar = mx.ones((1,))

    def __call__(self, x: mx.array, positions: mx.array, kv: tuple, mask) -> mx.array:
        h = self.self_attn(self.input_layernorm(x), positions, kv, mask)
        x = x + self.post_attention_layernorm(h)
        h = self.mlp(self.pre_feedforward_layernorm(x))
        x = x + self.post_feedforward_layernorm(h)
        return x * self.layer_scalar


class MaskedEmbedding(nn.Module):
    """The centroid head: logits only for the tokens of the top-k centroids."""

    def __init__(self, args: AssistantArgs):
        super().__init__()
        self.top_k = args.centroid_top_k
        self.per_centroid = args.vocab_size // args.num_centroids
        self.centroids = nn.Linear(args.hidden_size, args.num_centroids, bias=False)
        self.token_ordering = mx.zeros((args.vocab_size,), mx.int32)  # token ids, by centroid

    def __call__(self, z: mx.array, head_weight: mx.array) -> mx.array:
        B, L, _ = z.shape
        scores = self.centroids(z)  # [B, L, C]
        top = mx.argpartition(-scores, self.top_k - 1, axis=-1)[..., : self.top_k]  # [B, L, k]
        clusters = self.token_ordering.reshape(-1, self.per_centroid)  # [C, V/C]
        ids = clusters[top].reshape(B, L, -1)  # [B, L, k*V/C] token ids
        chosen = head_weight[ids]  # [B, L, k*V/C, d]
        logits = (chosen @ z[..., None]).squeeze(-1)  # [B, L, k*V/C]
        # transformers fills with the min over the whole call (all rows), minus one.
        out = mx.full((B, L, head_weight.shape[0]), logits.min() - 1.0, dtype=logits.dtype)
        return mx.put_along_axis(out, ids, logits, axis=-1)


class TextModel(nn.Module):
    """The assistant's decoder stack (HF prefix `model.`); embed_tokens is only its head."""

    def __init__(self, args: AssistantArgs):
        super().__init__()
        self.embed_tokens = nn.Embedding(args.vocab_size, args.hidden_size)
        freqs = {
            i: rope_inv_freq(args.rope_parameters[t], args.head_dims[i])
            for i, t in enumerate(args.layer_types)
        }
        self.layers = [DecoderLayer(args, i, freqs[i]) for i in range(len(args.layer_types))]
        self.norm = nn.RMSNorm(args.hidden_size, eps=args.rms_norm_eps)


class Gemma4Assistant(nn.Module):
    """`model(inputs_embeds [B, L, 2T], positions [B, L], shared_kv)` -> (logits [B, L, V],
    projected [B, L, T]); `shared_kv[layer_type]` = (keys, values) `[B, kv_heads, S, D]`."""

    def __init__(self, args: AssistantArgs):
        super().__init__()
        self.args = args
        self.pre_projection = nn.Linear(2 * args.backbone_hidden_size, args.hidden_size, bias=False)
        self.post_projection = nn.Linear(args.hidden_size, args.backbone_hidden_size, bias=False)
        self.model = TextModel(args)
        if not args.tie_word_embeddings:
            self.lm_head = nn.Linear(args.hidden_size, args.vocab_size, bias=False)
        if args.use_ordered_embeddings:
            self.masked_embedding = MaskedEmbedding(args)

    def head_weight(self) -> mx.array:
        """`[V, d]` output head: the tied embedding unless the config unties it."""
        if self.args.tie_word_embeddings:
            return self.model.embed_tokens.weight
        return self.lm_head.weight

    def __call__(self, inputs_embeds: mx.array, positions: mx.array, shared_kv: dict) -> tuple:
        x = self.pre_projection(inputs_embeds)  # [B, L, d]
        masks = self._masks(x.shape[1], shared_kv)
        for layer in self.model.layers:
            x = layer(x, positions, shared_kv[layer.layer_type], masks[layer.layer_type])
        z = self.model.norm(x)
        if self.args.use_ordered_embeddings:
            logits = self.masked_embedding(z, self.head_weight())
        else:
            logits = z @ self.head_weight().T  # [B, L, V]
        return logits, self.post_projection(z)

    def _masks(self, q_len: int, shared_kv: dict) -> dict:
        masks = {"full_attention": None}
        if "sliding_attention" in shared_kv:
            kv_len = shared_kv["sliding_attention"][0].shape[2]
            masks["sliding_attention"] = sliding_mask(q_len, kv_len, self.args.sliding_window)
        return masks


# --------------------------------------------------------------------------- loading


def read_config(where: Path) -> dict:
    """config.json of an assistant checkpoint directory."""
    try:
        return json.loads((where / "config.json").read_text())
    except FileNotFoundError as exc:
        raise FileNotFoundError(f"{where}: not a model directory (no config.json)") from exc


def _check_sizes(args: AssistantArgs, where: Path) -> None:
    if args.use_ordered_embeddings:
        if args.vocab_size % args.num_centroids:
            raise ValueError(
                f"{where}: vocab_size {args.vocab_size} is not a multiple of num_centroids "
                f"{args.num_centroids}"
            )
        if not 0 < args.centroid_top_k <= args.num_centroids:
            raise ValueError(f"{where}: centroid_intermediate_top_k must be in [1, num_centroids]")
    missing = [t for t in set(args.layer_types) if t not in args.rope_parameters]
    if missing:
        raise ValueError(f"{where}: rope_parameters has no entry for {', '.join(sorted(missing))}")


def read_weights(where: Path) -> dict[str, mx.array]:
    """Every tensor of the checkpoint's safetensors files (single file or sharded)."""
    files = sorted(where.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{where}: no *.safetensors weights")
    weights: dict[str, mx.array] = {}
    for file in files:
        weights.update(mx.load(str(file)))
    return weights


def check_weights(model: Gemma4Assistant, weights: dict, where: str) -> dict[str, mx.array]:
    """The checkpoint tensors the model takes, each name and shape checked (ValueError naming
    the first bad tensor otherwise); tied or ignored duplicates are dropped."""
    expected = dict(tree_flatten(model.parameters()))
    weights = {k: v for k, v in weights.items() if not k.endswith(IGNORED_SUFFIXES)}
    if model.args.tie_word_embeddings and "lm_head.weight" in weights:
        expected = {**expected, "lm_head.weight": expected["model.embed_tokens.weight"]}
    unknown = sorted(set(weights) - set(expected))
    missing = sorted(set(expected) - set(weights))
    if unknown:
        raise ValueError(f"{where}: unexpected tensor {unknown[0]} ({len(unknown)} unknown)")
    if missing:
        raise ValueError(f"{where}: missing tensor {missing[0]} ({len(missing)} missing)")
    for name, param in expected.items():
        if tuple(weights[name].shape) != tuple(param.shape):
            raise ValueError(
                f"{where}: tensor {name} has shape {tuple(weights[name].shape)}, "
                f"expected {tuple(param.shape)}"
            )
    if model.args.tie_word_embeddings:
        weights.pop("lm_head.weight", None)  # a saved copy of the tied embedding
    if model.args.use_ordered_embeddings:
        weights["masked_embedding.token_ordering"] = _token_ordering(weights, model.args, where)
    return weights


def _token_ordering(weights: dict, args: AssistantArgs, where: str) -> mx.array:
    ordering = weights["masked_embedding.token_ordering"].astype(mx.int32)
    if ordering.min().item() < 0 or ordering.max().item() >= args.vocab_size:
        raise ValueError(f"{where}: masked_embedding.token_ordering has ids outside the vocabulary")
    return ordering


def load_assistant(path: str | Path) -> Gemma4Assistant:
    """Load an HF-layout `gemma4_assistant` checkpoint (config.json + safetensors).

    Args:
        path: the checkpoint directory.
    Returns:
        The assistant, float32 on the CPU device (the checkpoint's dtype elsewhere).
    """
    where = Path(path)
    args = AssistantArgs.from_config(read_config(where), str(where))
    _check_sizes(args, where)
    model = Gemma4Assistant(args)
    weights = check_weights(model, read_weights(where), str(where))
    model.load_weights(list(weights.items()), strict=True)
    if mx.default_device() == mx.cpu:
        model.set_dtype(mx.float32)
        weight_layout.column_major(model)
    mx.eval(model.parameters())
    return model
