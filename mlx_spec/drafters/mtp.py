"""MTP drafters: the multi-token-prediction heads shipped with DeepSeek-V3/GLM, Qwen3.5/Next
and MiMo checkpoints, run on the target's hidden states.

The MTP module sees pairs (h_p, t_{p+1}): the target's hidden state at position p and the token
that followed. Its cache holds such pairs for the whole sequence. A round feeds the pending true
pairs and drafts k tokens by feeding its own output back (recursive reuse); after verification
every self-fed step is rolled back and the verified pairs, taken from the target pass, become
pending for the next round.
"""

from __future__ import annotations

import json
from pathlib import Path

from mlx_spec.core.sampling import SamplingConfig
from mlx_spec.decoding.runner import ModelRunner
from mlx_spec.drafters.base import Draft, Drafter, unique_id
from mlx_spec.drafters.draft_model import CATCH_UP, context_budget, draft_steps
from mlx_spec.models.mtp import MTPModule, target_hidden_size, target_layers
from mlx_spec.platform import weight_layout

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

MTP_DIR = "mtp"


class MTPDrafter(Drafter):
    """Drafts with an MTP head bound to its target model.

    Args:
        module: the MTP module, built on `target`.
        target: the model whose embedding, head and hidden states it uses.
    """

    name = "mtp"
    needs_hidden = True

    @property
    def identity(self):
        return (self.name, unique_id(self.module))

    def __init__(self, module: MTPModule, target: nn.Module):
        self.module = module
        self.target = target
        self.runner: ModelRunner | None = None
        self._pending_tokens: list[int] = []
        self._hidden_parts: list[mx.array] = []  # the pending pairs' hidden rows, joined on use
        self._num_drafted = 0

    @property
    def _pending_hidden(self) -> mx.array | None:
        """`[len(pending tokens), T]` hidden states of the pending pairs."""
        parts = self._hidden_parts
        if len(parts) > 1:
            self._hidden_parts = parts = [mx.concatenate(parts)]
        return parts[0] if parts else None

    @_pending_hidden.setter
    def _pending_hidden(self, value: mx.array | None) -> None:
        self._hidden_parts = [] if value is None else [value]

    def check_compatible(self, target: nn.Module, tokenizer, vocab_size: int) -> None:
        if target is not self.target:
            raise ValueError("this MTP drafter was loaded for another target model")

    def begin(self, prompt: list[int], vocab_size: int, hidden: mx.array | None = None) -> None:
        self.runner = ModelRunner(self.module, vocab_size)
        self._num_drafted = 0
        nexts = prompt[1:]  # the token after each position that has a hidden state
        if not nexts:
            self._pending_tokens, self._pending_hidden = [], None
            return
        self.runner.prefill(nexts[:-1], hidden=hidden[:-1])
        self._pending_tokens, self._pending_hidden = nexts[-1:], hidden[-1:]

    def extend(
        self,
        prompt: list[int],
        common: int,
        vocab_size: int,
        hidden: mx.array | None = None,
        hidden_start: int = 0,
    ) -> bool:
        """Keep the cached pairs of the shared prefix, feed the new ones. Pair p is
        (h_p, t_{p+1}); it stays valid while t_{p+1} is shared. The hidden states of new pairs
        come from the pending pairs (positions before `hidden_start`) and `hidden` (after)."""
        if self.runner is None or len(prompt) < 2:
            return False
        cached = self.runner.length
        keep = max(0, min(cached, common - 1, len(prompt) - 2))  # pairs kept in the cache
        rows = []
        if hidden_start > keep:  # positions keep .. hidden_start - 1 must be pending pairs
            have = len(self._pending_tokens)
            if keep < cached or hidden_start > cached + have or self._pending_hidden is None:
                return False
            rows.append(self._pending_hidden[keep - cached : hidden_start - cached])
        if hidden is not None and hidden.shape[0]:
            rows.append(hidden[max(0, keep - hidden_start) :])
        states = mx.concatenate(rows) if rows else None
        if states is None or states.shape[0] != len(prompt) - 1 - keep:
            return False
        if not self.runner.truncate(keep):
            return False
        nexts = prompt[keep + 1 :]  # the token after each position keep .. len(prompt) - 2
        self.runner.prefill(nexts[:-1], hidden=states[:-1])
        self._pending_tokens, self._pending_hidden = nexts[-1:], states[-1:]
        self._num_drafted = 0
        return True

    def catch_up(self) -> None:
        """Feed every pending pair but the last (which the next draft feeds)."""
        backlog = len(self._pending_tokens) - 1
        if backlog < CATCH_UP or self._num_drafted or self.runner is None:
            return
        limit = self.runner.context_limit
        if limit is not None and self.runner.length + backlog + 1 >= limit:
            return
        hidden = self._pending_hidden
        self.runner.prefill(self._pending_tokens[:-1], hidden=hidden[:-1])
        self._pending_tokens, self._pending_hidden = self._pending_tokens[-1:], hidden[-1:]

    def draft(self, k: int, sampling: SamplingConfig) -> Draft:
        pending = len(self._pending_tokens)
        k = context_budget(self.runner, k, pending) if pending else 0
        self._num_drafted = k
        if k == 0:
            return Draft.empty()
        self.runner.checkpoint(pending + k - 1, single_call=False)
        tokens = mx.array(self._pending_tokens, mx.uint32)
        return draft_steps(
            self.runner,
            tokens,
            k,
            sampling,
            hidden=self._pending_hidden,
            feedback=lambda: self.module.feedback[0, -1:],
        )

    def accept(self, num_accepted: int, emitted: list[int], hidden: mx.array | None = None) -> None:
        if self._num_drafted:
            # Keep the true pairs fed at the start of the round; drop every self-fed step.
            self.runner.rollback(len(self._pending_tokens))
            self._pending_tokens, self._pending_hidden = list(emitted), hidden
        else:  # nothing drafted (plain steps): the pairs pile up until the next draft
            self._pending_tokens += emitted
            self._hidden_parts += [] if hidden is None else [hidden]
        self._num_drafted = 0


def save_mtp_drafter(
    out: Path, module: MTPModule, target_config: dict, *, quantization: dict | None = None
) -> None:
    """Write an MTP drafter directory (weights + config) that `load_mtp_drafter` opens."""
    out.mkdir(parents=True, exist_ok=True)
    tensors = dict(tree_flatten(module.parameters()))
    mx.save_safetensors(str(out / "model.safetensors"), tensors, metadata={"format": "mlx"})
    text = target_config.get("text_config", target_config)
    config = {
        "model_type": "mtp",
        "mtp_family": module.family,
        "target_model_type": target_config["model_type"],
        "num_mtp_layers": len(module.layers),
        "target_layer_index": module.template_index,
        "hidden_size": text["hidden_size"],
        "vocab_size": text["vocab_size"],
        "norm_convention": "x*w",
        "target": "..",
        "shared_with_target": [
            name
            for name, own in (
                ("embed_tokens", "embed_tokens.weight"),
                ("lm_head", "shared_head.head.weight"),
            )
            if own not in module.own_copies
        ],
        "own_copies": list(module.own_copies),
        "quantization": quantization,
        "target_config": target_config,
    }
    (out / "config.json").write_text(json.dumps(config, indent=2))


def _text_args(model: nn.Module) -> dict:
    args = model.args
    text = getattr(args, "text_config", None)
    return text if isinstance(text, dict) else vars(args)


def _check_target(config: dict, target: nn.Module, where: Path) -> None:
    text = _text_args(target)
    want = {
        "target model type": (config["target_model_type"], target.args.model_type),
        "hidden size": (config["hidden_size"], target_hidden_size(target)),
        "vocabulary": (config["vocab_size"], text.get("vocab_size")),
    }
    for what, (mtp_value, target_value) in want.items():
        if mtp_value != target_value:
            raise ValueError(
                f"{where}: MTP drafter does not match the target: {what} {mtp_value} vs "
                f"{target_value}"
            )
    index = config["target_layer_index"]
    if not 0 <= index < len(target_layers(target)):
        raise ValueError(f"{where}: target has no layer {index} to take the MTP layer kind from")


def locate_mtp(path: Path) -> Path:
    """The MTP drafter directory: `path` itself, or `path/mtp` beside a converted target."""
    if (path / MTP_DIR / "config.json").is_file():
        return path / MTP_DIR
    if (path / "config.json").is_file():
        if json.loads((path / "config.json").read_text()).get("model_type") != "mtp":
            raise ValueError(
                f"{path}: this checkpoint has no MTP drafter (no {MTP_DIR}/ directory); only "
                "checkpoints that ship MTP layers, converted with `mlx-spec convert`, have one"
            )
    return path


def _read_config(where: Path) -> dict:
    try:
        config = json.loads((where / "config.json").read_text())
    except FileNotFoundError as exc:
        raise FileNotFoundError(f"{where}: no MTP drafter here (no config.json)") from exc
    if config.get("model_type") != "mtp":
        raise ValueError(f"{where}: not an MTP drafter directory (model_type is not 'mtp')")
    return config


def _quantize_like_saved(module: nn.Module, quant: dict, weights: dict) -> None:
    """Quantize the modules the saved weights hold quantized (per-path settings honoured)."""

    def predicate(path: str, m: nn.Module):
        if not hasattr(m, "to_quantized") or f"{path}.scales" not in weights:
            return False
        return quant[path] if isinstance(quant.get(path), dict) else True

    nn.quantize(module, quant["group_size"], quant["bits"], class_predicate=predicate)


def load_mtp_drafter(path: str | Path, target: nn.Module) -> MTPDrafter:
    """Load the MTP drafter written by `mlx-spec convert` for `target`.

    Args:
        path: the drafter directory, or the converted target directory holding it in `mtp/`.
        target: the loaded target model.
    Returns:
        An `MTPDrafter` usable as `drafter=`.
    """
    where = locate_mtp(Path(path))
    config = _read_config(where)
    _check_target(config, target, where)
    eps = _text_args(target).get("rms_norm_eps", 1e-6)
    module = MTPModule(
        config["mtp_family"],
        target,
        config["target_layer_index"],
        eps,
        num_layers=config.get("num_mtp_layers", 1),
        own_copies=tuple(config.get("own_copies", ())),
    )
    weights = mx.load(str(where / "model.safetensors"))
    if config.get("quantization"):
        _quantize_like_saved(module, config["quantization"], weights)
    try:
        module.load_weights(list(weights.items()), strict=True)
    except ValueError as exc:
        raise ValueError(f"{where}: MTP weights do not fit the target's layer kind: {exc}") from exc
    if mx.default_device() == mx.cpu:
        module.set_dtype(mx.float32)
        weight_layout.column_major(module)
    mx.eval(module.parameters())
    return MTPDrafter(module, target)
