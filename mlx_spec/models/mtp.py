"""Multi-token-prediction heads shipped inside checkpoints, run on the target's hidden states.

One module for the three published layouts (T = target hidden size; e = target embedding,
h = target hidden state after its final norm):

- DeepSeek-V3 / GLM: x = eh_proj([enorm(e), hnorm(h)]); x = layer(x);
  logits = head(shared_head.norm(x)); the next step is fed x (before the norm).
- Qwen3.5 / Qwen3-Next: x = fc([pre_fc_norm_embedding(e), pre_fc_norm_hidden(h)]); x = layer(x);
  z = norm(x); logits = head(z); the next step is fed z.
- MiMo: x = input_proj([hidden_layernorm(h), token_layernorm(e)]) (hidden first); x = layer(x);
  z = final_layernorm(x); logits = head(z); the next step is fed z.

The decoder layer is a copy of one of the target's own layers (same mlx-lm class, so the same
attention and MLP kinds), loaded with the MTP weights. Embedding and head are the target's.
"""

from __future__ import annotations

import copy

from mlx_spec.caches.taps import at_positions, find_embedding, find_head

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.base import create_attention_mask
from mlx_lm.models.cache import KVCache

FAMILIES = ("deepseek_v3", "qwen3_5", "mimo")


def target_layers(model: nn.Module) -> list:
    """The decoder layers of an mlx-lm model (`model.layers` on every architecture)."""
    return list(model.layers)


class MTPModule(nn.Module):
    """An MTP head: `module(tokens [1, S], cache=..., hidden=[1, S, T]) -> logits [1, S, V]`.

    Every MTP layer of the checkpoint is kept; drafting reuses layer 0 recursively.

    Args:
        family: "deepseek_v3", "qwen3_5" or "mimo".
        target: the target model (its embedding, head and a layer to copy).
        layer_index: which target layer is of the MTP layer's kind.
        eps: RMSNorm epsilon of the target.
        num_layers: MTP layers in the checkpoint.
        own_copies: DeepSeek-style tensors the checkpoint ships that differ from the target's
            ("embed_tokens.weight", "shared_head.head.weight"); used instead of the target's.
    """

    def __init__(
        self,
        family: str,
        target: nn.Module,
        layer_index: int,
        eps: float,
        num_layers: int = 1,
        own_copies: tuple[str, ...] = (),
    ):
        super().__init__()
        if family not in FAMILIES:
            raise ValueError(f"unknown MTP family {family!r}; known: {', '.join(FAMILIES)}")
        self.family = family
        self.template_index = layer_index  # the target layer whose kind the MTP layers share
        self.own_copies = tuple(own_copies)
        hidden = target_hidden_size(target)
        template = target_layers(target)[layer_index]
        self.layers = [self._layer(copy.deepcopy(template), hidden, eps) for _ in range(num_layers)]
        if family == "qwen3_5":
            self.fc = nn.Linear(2 * hidden, hidden, bias=False)
            self.pre_fc_norm_embedding = nn.RMSNorm(hidden, eps)
            self.pre_fc_norm_hidden = nn.RMSNorm(hidden, eps)
            self.norm = nn.RMSNorm(hidden, eps)
        self.args = target.args  # context limit and vocabulary, as the target's
        embed, (head, method) = find_embedding(target), find_head(target)
        vocab = embed.weight.shape[0]
        if "embed_tokens.weight" in own_copies:
            self.layers[0].embed_tokens = embed = nn.Embedding(vocab, hidden)
        if "shared_head.head.weight" in own_copies:
            self.layers[0].shared_head.head = head = nn.Linear(hidden, vocab, bias=False)
            method = "__call__"
        # The target's modules, held outside the parameter tree (they are not ours to save).
        object.__setattr__(self, "_embed", embed)
        object.__setattr__(self, "_head", (head, method))
        # What the next draft step is fed as `hidden`; kept out of the parameter tree.
        object.__setattr__(self, "feedback", None)

    def _layer(self, layer: nn.Module, hidden: int, eps: float) -> nn.Module:
        """A copy of a target layer with the family's projection and norms attached."""
        if self.family == "deepseek_v3":
            layer.enorm, layer.hnorm = nn.RMSNorm(hidden, eps), nn.RMSNorm(hidden, eps)
            layer.eh_proj = nn.Linear(2 * hidden, hidden, bias=False)
            layer.shared_head = nn.Module()
            layer.shared_head.norm = nn.RMSNorm(hidden, eps)
        elif self.family == "mimo":
            layer.token_layernorm = nn.RMSNorm(hidden, eps)
            layer.hidden_layernorm = nn.RMSNorm(hidden, eps)
            layer.input_proj = nn.Linear(2 * hidden, hidden, bias=False)
            layer.final_layernorm = nn.RMSNorm(hidden, eps)
        return layer

    def make_cache(self) -> list:
        return [KVCache()]

    def _project(self, e: mx.array, h: mx.array) -> mx.array:
        layer = self.layers[0]
        if self.family == "deepseek_v3":
            return layer.eh_proj(mx.concatenate([layer.enorm(e), layer.hnorm(h)], axis=-1))
        if self.family == "mimo":
            joined = [layer.hidden_layernorm(h), layer.token_layernorm(e)]  # hidden first
            return layer.input_proj(mx.concatenate(joined, axis=-1))
        joined = [self.pre_fc_norm_embedding(e), self.pre_fc_norm_hidden(h)]
        return self.fc(mx.concatenate(joined, axis=-1))

    def __call__(
        self, tokens: mx.array, cache: list, hidden: mx.array, at: mx.array | None = None
    ) -> mx.array:
        """Logits `[B, S, V]`; with `at` (`[B]` positions) only row i's position `at[i]`:
        `[B, 1, V]`, and `feedback` as narrow (what a catch-up over many positions needs)."""
        layer = self.layers[0]
        e = self._embed(tokens)
        x = self._project(e, hidden.astype(e.dtype))
        x = layer(x, create_attention_mask(x, cache[0], return_array=True), cache[0])
        if at is not None:
            x = at_positions(x, at)
        if self.family == "deepseek_v3":
            z, feedback = layer.shared_head.norm(x), x
        else:
            z = layer.final_layernorm(x) if self.family == "mimo" else self.norm(x)
            feedback = z
        object.__setattr__(self, "feedback", feedback)
        head, method = self._head
        return getattr(head, method)(z)


def target_hidden_size(model: nn.Module) -> int:
    args = model.args
    text = getattr(args, "text_config", None)
    if isinstance(text, dict) and "hidden_size" in text:
        return text["hidden_size"]
    return args.hidden_size
