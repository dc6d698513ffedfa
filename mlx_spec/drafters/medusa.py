"""Medusa heads (Cai et al. 2024): extra decoding heads on the target's final hidden state.

Head k maps the hidden state at position t (after the final norm) through `num_layers`
residual blocks `x + SiLU(W x + b)` and its own output layer to a guess of the token at
t + 2 + k (the target's own head guesses t + 1). Candidates form a tree: the paths whose
product of head probabilities is highest, grown best-first under a node budget, each node a
deterministic pick (one-hot for the lossless verifier, so sampling stays exact whatever the
heads say).

Layouts read (safetensors, or a `.pt` file through `torch.load(weights_only=True)` when torch
is installed; never a plain unpickle):
- the original Medusa (`medusa_lm_head.*`): `{k}.{j}.linear.weight|bias` for j < L and
  `{k}.{L}.weight`; config `medusa_num_heads`, `medusa_num_layers`; also with a
  `medusa_head.` prefix (Medusa-2 checkpoints that bundle the base model);
- vLLM / speculators (`model_type: medusa`): `blocks.{k}.layers.{j}.weight|bias` and
  `lm_heads.{k}.weight`; config `num_heads`, `num_hidden_layers`.
"""

from __future__ import annotations

import heapq
import json
import re
from pathlib import Path

from mlx_spec.core.sampling import SamplingConfig
from mlx_spec.core.tree_verify import TokenTree
from mlx_spec.decoding.tree import TreeDrafter

import mlx.core as mx
import mlx.nn as nn
import numpy as np

WEIGHT_FILES = ("medusa_lm_head.safetensors", "model.safetensors", "medusa_lm_head.pt")


class _ResBlock(nn.Module):
    def __init__(self, size: int):
        super().__init__()
        self.linear = nn.Linear(size, size)

    def __call__(self, x: mx.array) -> mx.array:
        return x + nn.silu(self.linear(x))


class _Head(nn.Module):
    def __init__(self, hidden: int, vocab: int, layers: int):
        super().__init__()
        self.blocks = [_ResBlock(hidden) for _ in range(layers)]
        self.out = nn.Linear(hidden, vocab, bias=False)

    def __call__(self, x: mx.array) -> mx.array:
        for block in self.blocks:
            x = block(x)
        return self.out(x)


class MedusaHeads(nn.Module):
    """`num_heads` Medusa heads over `hidden`-wide states, each with `num_layers` blocks."""

    def __init__(self, hidden: int, vocab: int, num_heads: int, num_layers: int = 1):
        super().__init__()
        self.hidden, self.vocab = hidden, vocab
        self.num_heads, self.num_layers = num_heads, num_layers
        self.heads = [_Head(hidden, vocab, num_layers) for _ in range(num_heads)]

    def __call__(self, h: mx.array, count: int | None = None) -> mx.array:
        """`[..., hidden]` -> `[count, ..., vocab]` logits of the first `count` heads."""
        heads = self.heads[: self.num_heads if count is None else count]
        return mx.stack([head(h) for head in heads])


# --- loading -----------------------------------------------------------------------------------

_ORIGINAL = re.compile(
    r"^(?:medusa_head\.|medusa_lm_head\.)?(\d+)\.(\d+)\.(linear\.)?(weight|bias)$"
)
_VLLM_BLOCK = re.compile(r"^(?:model\.)?blocks\.(\d+)\.layers\.(\d+)\.(weight|bias)$")
_VLLM_HEAD = re.compile(r"^(?:model\.)?lm_heads\.(\d+)\.weight$")


def _read_weights(path: Path) -> dict[str, mx.array]:
    if path.suffix == ".pt":
        try:
            import torch
        except ImportError:
            raise ValueError(
                f"{path.name} is a PyTorch file; install torch to read it (weights only), or "
                "convert the heads to safetensors"
            ) from None
        state = torch.load(path, map_location="cpu", weights_only=True)
        return {k: mx.array(v.float().numpy()) for k, v in state.items()}
    return mx.load(str(path))


def _weights_file(directory: Path) -> Path:
    for name in WEIGHT_FILES:
        if (directory / name).is_file():
            return directory / name
    found = sorted(directory.glob("*.safetensors"))
    if len(found) == 1:
        return found[0]
    raise ValueError(f"no Medusa weights in {directory} (looked for {', '.join(WEIGHT_FILES)})")


def medusa_params(weights: dict[str, mx.array]) -> tuple[dict[str, mx.array], int, int]:
    """Medusa tensors of either layout renamed to `MedusaHeads`' names; (params, heads,
    layers). Other tensors (a bundled base model) are ignored."""
    blocks: dict[tuple[int, int, str], mx.array] = {}
    outs: dict[int, mx.array] = {}
    original = {}
    for name, value in weights.items():
        if m := _VLLM_BLOCK.match(name):
            blocks[(int(m[1]), int(m[2]), m[3])] = value
        elif m := _VLLM_HEAD.match(name):
            outs[int(m[1])] = value
        elif m := _ORIGINAL.match(name):
            original[(int(m[1]), int(m[2]), bool(m[3]), m[4])] = value
    if original:
        depth = {}
        for k, j, _, _ in original:
            depth[k] = max(depth.get(k, 0), j)
        for (k, j, linear, kind), value in original.items():
            if j == depth[k] and not linear:
                if kind != "weight":
                    raise ValueError(
                        f"Medusa head {k}'s output layer has a {kind}: not a Medusa layout"
                    )
                outs[k] = value
            elif linear:
                blocks[(k, j, kind)] = value
            else:
                raise ValueError(f"unexpected Medusa tensor for head {k}, layer {j}: {kind}")
    if not outs:
        raise ValueError("no Medusa head tensors found (neither the Medusa nor the vLLM layout)")
    heads = max(outs) + 1
    layers = 1 + max((j for _, j, _ in blocks), default=-1)
    params = {}
    for k in range(heads):
        if k not in outs:
            raise ValueError(f"Medusa head {k} has no output layer")
        params[f"heads.{k}.out.weight"] = outs[k]
        for j in range(layers):
            for kind in ("weight", "bias"):
                if (k, j, kind) not in blocks:
                    raise ValueError(f"Medusa head {k} misses its block {j} {kind}")
                params[f"heads.{k}.blocks.{j}.linear.{kind}"] = blocks[(k, j, kind)]
    return params, heads, layers


def load_medusa_heads(path: str, dtype: mx.Dtype | None = None) -> MedusaHeads:
    """Medusa heads from a directory (or a weights file) in either layout, in `dtype` (default:
    as stored; float32 on the CPU)."""
    source = Path(path)
    if not source.exists():
        raise ValueError(f"no Medusa heads at {path}")
    file = source if source.is_file() else _weights_file(source)
    params, heads, layers = medusa_params(_read_weights(file))
    config_path = file.parent / "config.json"
    if config_path.is_file():
        config = json.loads(config_path.read_text())
        want = config.get("medusa_num_heads", config.get("num_heads"))
        if want is not None and want > heads:
            raise ValueError(f"the config names {want} Medusa heads; the weights hold {heads}")
    return medusa_heads(params, heads, layers, dtype)


def medusa_heads(params: dict, heads: int, layers: int, dtype=None) -> MedusaHeads:
    """`MedusaHeads` from `medusa_params`' output, every shape checked, in `dtype` (default: as
    given; float32 on the CPU)."""
    vocab, hidden = params["heads.0.out.weight"].shape
    for name, value in params.items():
        expected = {"out.weight": (vocab, hidden), "linear.weight": (hidden, hidden)}
        expected["linear.bias"] = (hidden,)
        for suffix, shape in expected.items():
            if name.endswith(suffix) and tuple(value.shape) != shape:
                raise ValueError(f"{name} has shape {tuple(value.shape)}, expected {shape}")
    module = MedusaHeads(hidden, vocab, heads, layers)
    if dtype is None and mx.default_device() == mx.cpu:
        dtype = mx.float32  # the only fast matmul on the CPU, as `mlx_spec.load` does
    if dtype is not None:
        params = {k: v.astype(dtype) for k, v in params.items()}
    module.load_weights(list(params.items()))
    mx.eval(module.parameters())
    return module


def save_medusa_heads(module: MedusaHeads, directory: str) -> Path:
    """Write heads in the original Medusa layout (`medusa_lm_head.safetensors` + config)."""
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    tensors = {}
    for k, head in enumerate(module.heads):
        for j, block in enumerate(head.blocks):
            tensors[f"{k}.{j}.linear.weight"] = block.linear.weight
            tensors[f"{k}.{j}.linear.bias"] = block.linear.bias
        tensors[f"{k}.{module.num_layers}.weight"] = head.out.weight
    mx.save_safetensors(str(out / "medusa_lm_head.safetensors"), tensors)
    config = {
        "medusa_num_heads": module.num_heads,
        "medusa_num_layers": module.num_layers,
        "hidden_size": module.hidden,
        "vocab_size": module.vocab,
    }
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return out


# --- drafting ----------------------------------------------------------------------------------


def best_paths(probs: np.ndarray, budget: int) -> list[tuple[int, ...]]:
    """The `budget` paths (tuples of candidate ranks per depth, depth d ranking head d's
    tokens) of highest product of probabilities, every path's prefix included, best first.

    Args:
        probs: `[depth, width]` each head's top probabilities, in decreasing order.
    """
    depth, width = probs.shape
    chosen: list[tuple[int, ...]] = []
    heap = [(-probs[0, 0], (0,), 1.0)]  # (-score, path, score of the path's prefix)
    while heap and len(chosen) < budget:
        neg, path, prefix = heapq.heappop(heap)
        chosen.append(path)
        d, rank = len(path) - 1, path[-1]
        if rank + 1 < width:  # the next sibling: same prefix, the next candidate
            heapq.heappush(heap, (-prefix * probs[d, rank + 1], path[:-1] + (rank + 1,), prefix))
        if d + 1 < depth:  # the first child
            heapq.heappush(heap, (neg * probs[d + 1, 0], path + (0,), -neg))
    return chosen


class MedusaDrafter(TreeDrafter):
    """Drafts a token tree from Medusa heads on the target's last hidden state.

    Args:
        heads: the `MedusaHeads`.
        width: candidates per head considered.
        tree_size: nodes per tree at most (None: 2 per level of depth).
    """

    name = "medusa"
    needs_hidden = True

    def __init__(self, heads: MedusaHeads, width: int = 3, tree_size: int | None = None):
        self.heads, self.width, self.tree_size = heads, width, tree_size
        self._hidden: mx.array | None = None  # [T] at the last token in the target's cache

    @property
    def max_depth(self) -> int:
        return self.heads.num_heads

    def check_compatible(self, hidden_size: int, vocab_size: int) -> None:
        if self.heads.hidden != hidden_size:
            raise ValueError(
                f"the Medusa heads read {self.heads.hidden}-wide hidden states; "
                f"the target's are {hidden_size}-wide"
            )
        if self.heads.vocab < vocab_size:
            raise ValueError(
                f"the Medusa heads predict {self.heads.vocab} tokens; the target's vocabulary "
                f"has {vocab_size}"
            )

    def begin(self, prompt: list[int], hidden: mx.array | None) -> None:
        self._hidden = None if hidden is None or hidden.shape[0] == 0 else hidden[-1]

    def accept(self, tokens: list[int], hidden: mx.array | None) -> None:
        self._hidden = None if hidden is None else hidden[-1]

    def draft_tree(self, depth: int, vocab_size: int, sampling: SamplingConfig) -> TokenTree:
        """A tree of up to `depth` levels under the pending token."""
        if self._hidden is None or depth <= 0:
            return TokenTree([], [])
        depth = min(depth, self.heads.num_heads)
        logits = self.heads(self._hidden, depth)[:, :vocab_size].astype(mx.float32)  # [d, V]
        width = min(self.width, vocab_size)
        top = mx.argpartition(-logits, kth=width - 1, axis=-1)[:, :width]
        top_p = mx.exp(mx.take_along_axis(logits, top, axis=-1) - mx.logsumexp(logits, -1, True))
        mx.eval(top, top_p)
        top, top_p = np.array(top), np.array(top_p, dtype=np.float64)
        order = np.argsort(-top_p, axis=-1, kind="stable")  # each head's candidates, best first
        top, top_p = np.take_along_axis(top, order, -1), np.take_along_axis(top_p, order, -1)
        budget = self.tree_size or 2 * depth
        paths = best_paths(top_p, budget)
        rank = {path: i for i, path in enumerate(paths)}
        paths.sort(key=lambda p: (len(p), rank[p]))  # breadth first, best first
        index = {path: i for i, path in enumerate(paths)}
        tokens = [int(top[len(p) - 1, p[-1]]) for p in paths]
        parents = [index[p[:-1]] if len(p) > 1 else -1 for p in paths]
        return TokenTree(tokens, parents)
