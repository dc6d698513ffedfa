"""Gemma 4 assistant drafter: a small model that attends over the target's own K/V.

The assistant has no cache. Each round it reads, from the target's cache, the K/V of the last
full-attention layer and the last sliding layer that own a cache (layers that share K/V read
those of such a layer), and drafts k tokens at one fixed position: the position of the last
token, whose K/V the target has not computed yet. Step i feeds
`concat(e_target(t) * sqrt(T), h)` and returns logits and the next `h`: step 0 takes the last
emitted token and the target's hidden state that predicted it, later steps take the drafted
token and the assistant's own projected state.
"""

from __future__ import annotations

from pathlib import Path

from mlx_spec.core.sampling import SamplingConfig
from mlx_spec.drafters.base import Draft, Drafter, unique_id
from mlx_spec.drafters.draft_model import pick_token
from mlx_spec.models.gemma4_assistant import (
    AssistantArgs,
    Gemma4Assistant,
    load_assistant,
    read_config,
)

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.cache import KVCache, RotatingKVCache


def gemma4_text_model(target: nn.Module) -> nn.Module:
    """The mlx-lm `gemma4_text` model of a Gemma 4 target (itself, or a `gemma4` model's
    `language_model`); ValueError for any other target."""
    for model in (target, getattr(target, "language_model", None)):
        if getattr(getattr(model, "args", None), "model_type", None) == "gemma4_text":
            return model
    kind = getattr(getattr(target, "args", None), "model_type", type(target).__name__)
    raise ValueError(f"a Gemma 4 assistant needs a Gemma 4 (gemma4_text) target, not {kind!r}")


def kv_owners(text_args, layer_types: set[str]) -> dict[str, int]:
    """{layer type: index of the target's last cache-owning layer of that type}; the index is
    also the layer's place in the target's cache list (shared layers have no cache)."""
    num_owning = text_args.num_hidden_layers - text_args.num_kv_shared_layers
    owners = {t: i for i, t in enumerate(text_args.layer_types[:num_owning])}  # last wins
    missing = sorted(layer_types - set(owners))
    if missing:
        raise ValueError(f"the target has no cache-owning {' / '.join(missing)} layer to share")
    return {t: owners[t] for t in sorted(layer_types)}


def check_pair(args: AssistantArgs, target: nn.Module, where: str) -> dict[str, int]:
    """Raise ValueError unless the assistant fits the target; returns the K/V owners."""
    text = gemma4_text_model(target)
    if args.backbone_hidden_size != text.args.hidden_size:
        raise ValueError(
            f"{where}: assistant backbone_hidden_size {args.backbone_hidden_size} does not match "
            f"the target's hidden size {text.args.hidden_size}"
        )
    if args.vocab_size != text.args.vocab_size:
        raise ValueError(
            f"{where}: assistant vocabulary {args.vocab_size} does not match the target's "
            f"{text.args.vocab_size}"
        )
    owners = kv_owners(text.args, set(args.layer_types))
    for kind, index in owners.items():
        attn = text.model.layers[index].self_attn
        if attn.head_dim != args.head_dim_of(kind) or args.num_attention_heads % attn.n_kv_heads:
            raise ValueError(
                f"{where}: assistant {kind} heads ({args.num_attention_heads} x "
                f"{args.head_dim_of(kind)}) cannot attend over target layer {index}'s K/V "
                f"({attn.n_kv_heads} x {attn.head_dim})"
            )
    return owners


def prefix_kv(cache: KVCache) -> tuple[mx.array, mx.array]:
    """`[1, kv_heads, offset, D]` keys and values of a full-attention cache."""
    return cache.keys[..., : cache.offset, :], cache.values[..., : cache.offset, :]


def window_kv(cache: RotatingKVCache) -> tuple[mx.array, mx.array]:
    """A sliding cache's valid entries in position order, newest last (the buffer is a ring
    once one-token writes wrapped past its end; `_idx` is where the next write goes)."""
    idx = cache._idx
    if idx < cache.offset and idx < cache.keys.shape[2]:
        return tuple(
            mx.concatenate([v[..., idx:, :], v[..., :idx, :]], axis=2)
            for v in (cache.keys, cache.values)
        )
    return cache.keys[..., :idx, :], cache.values[..., :idx, :]


class Gemma4AssistantDrafter(Drafter):
    """Drafts with a Gemma 4 assistant over its target's cache.

    Args:
        assistant: the loaded assistant model.
        target: the target it serves (an mlx-lm `gemma4_text` or `gemma4` model).
    """

    name = "gemma4-assistant"
    reads_target_cache = True  # its attention reads the target's K/V (not on a sharded target)
    needs_hidden = True

    @property
    def identity(self):
        return (self.name, unique_id(self.assistant))

    def __init__(self, assistant: Gemma4Assistant, target: nn.Module, where: str = "assistant"):
        self.owners = check_pair(assistant.args, target, where)
        self.assistant = assistant
        self.target = target
        text = gemma4_text_model(target)
        self._embed = text.model.embed_tokens
        self._embed_scale = text.args.hidden_size**0.5  # the target's own input scaling
        self._window = min(assistant.args.sliding_window, text.args.sliding_window)
        self._runner = None
        self._vocab = 0
        self._token: int | None = None
        self._hidden: mx.array | None = None  # [1, T]
        self._length = 0  # tokens in the sequence, `_token` included

    def check_compatible(self, target: nn.Module, tokenizer, vocab_size: int) -> None:
        if target is not self.target:
            raise ValueError("this Gemma 4 assistant was loaded for another target model")
        if vocab_size > self.assistant.args.vocab_size:
            raise ValueError(
                f"the assistant scores {self.assistant.args.vocab_size} tokens but the target "
                f"generates {vocab_size}"
            )

    def bind_target(self, target) -> None:
        if target.model is not self.target:
            raise ValueError("bind_target got the runner of another model than the target")
        for kind, index in self.owners.items():
            cache = target.cache[index]
            want = RotatingKVCache if kind == "sliding_attention" else KVCache
            if type(cache) is not want or getattr(cache, "keep", 0):
                raise ValueError(
                    f"target cache {index} ({kind}) is a {type(cache).__name__}; the assistant "
                    f"reads a {want.__name__}"
                )
        self._runner = target

    def begin(self, prompt: list[int], vocab_size: int, hidden: mx.array | None = None) -> None:
        if self._runner is None:
            raise RuntimeError("call bind_target(target_runner) before begin")
        self._vocab = vocab_size
        self._token = prompt[-1]
        # A one-token prompt has no hidden state yet: the first round drafts nothing.
        self._hidden = hidden[-1:] if hidden is not None and hidden.shape[0] else None
        self._length = len(prompt)

    def extend(self, prompt, common, vocab_size, hidden=None, hidden_start=0) -> bool:
        """Only the last token and the hidden state that predicted it are needed: from the
        target's new hidden states, or kept when the prompt adds one token to the sequence."""
        if hidden is not None and hidden.shape[0]:
            self.begin(prompt, vocab_size, hidden)
            return True
        same_state = self._length == len(prompt) and common >= len(prompt) - 1
        if len(prompt) > 1 and not (same_state and self._hidden is not None):
            return False
        self.begin(prompt, vocab_size, self._hidden if len(prompt) > 1 else None)
        return True

    def draft(self, k: int, sampling: SamplingConfig) -> Draft:
        if k == 0 or self._hidden is None:
            return Draft.empty()
        shared = self._shared_kv()
        positions = mx.array([[self._runner.length]])  # [1, 1]: the last token's position
        token, h = mx.array([self._token], mx.uint32), self._hidden
        tokens, probs = [], []
        for _ in range(k):
            e = self._embed(token) * self._embed_scale  # [1, T]
            x = mx.concatenate([e, h.astype(e.dtype)], axis=-1)[None]  # [1, 1, 2T]
            logits, h = self.assistant(x, positions, shared)
            token, dist = pick_token(logits[0, -1, : self._vocab], sampling)
            probs += [] if dist is None else [dist]
            h = h[0]  # [1, T]
            mx.async_eval(token, h)
            tokens.append(token)
            token = token.reshape(1)
        return Draft(mx.stack(tokens).reshape(-1), mx.stack(probs) if probs else None)

    def accept(self, num_accepted: int, emitted: list[int], hidden: mx.array | None = None) -> None:
        # No cache of its own: only the last token and the hidden state that predicted it.
        self._token = emitted[-1]
        self._hidden = None if hidden is None else hidden[-1:]
        self._length += len(emitted)

    def _shared_kv(self) -> dict[str, tuple[mx.array, mx.array]]:
        """{layer type: (keys, values) `[1, kv_heads, S, D]`} read from the target's cache."""
        length = self._runner.length
        out = {}
        for kind, index in self.owners.items():
            cache = self._runner.cache[index]
            if cache.offset != length:
                raise RuntimeError(
                    f"target cache {index} holds {cache.offset} tokens, not {length}"
                )
            out[kind] = window_kv(cache) if kind == "sliding_attention" else prefix_kv(cache)
        if "sliding_attention" in out:
            out["sliding_attention"] = self._last(
                out["sliding_attention"], min(self._window, length)
            )
        return out

    @staticmethod
    def _last(kv: tuple[mx.array, mx.array], n: int) -> tuple[mx.array, mx.array]:
        """The newest n entries. Always the same n for a given length: the target's sliding
        cache keeps only `window` entries after some rounds (transformers' mask would take
        window + 1 when present), so drafts depend on the sequence alone."""
        if kv[0].shape[2] < n:
            raise RuntimeError(f"target sliding cache holds {kv[0].shape[2]} entries, need {n}")
        return kv[0][..., kv[0].shape[2] - n :, :], kv[1][..., kv[1].shape[2] - n :, :]


def load_gemma4_assistant(path: str | Path, target: nn.Module) -> Gemma4AssistantDrafter:
    """Load a Gemma 4 assistant checkpoint (HF layout) as the drafter for `target`.

    Args:
        path: the assistant directory (config.json with model_type gemma4_assistant +
            safetensors).
        target: the loaded Gemma 4 target, e.g. from `mlx_spec.load`.
    Returns:
        A `Gemma4AssistantDrafter` usable as `drafter=`.
    """
    where = Path(path)
    check_pair(AssistantArgs.from_config(read_config(where), str(where)), target, str(where))
    return Gemma4AssistantDrafter(load_assistant(where), target, str(where))
