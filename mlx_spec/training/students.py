"""The drafter being trained (the student) of each kind: built fresh, or loaded to train further."""

from __future__ import annotations

import json
from pathlib import Path

from mlx_spec.caches.taps import find_head
from mlx_spec.drafters.dflash import DFlashDrafter
from mlx_spec.drafters.eagle3 import Eagle3Drafter
from mlx_spec.drafters.medusa import (
    MedusaDrafter,
    MedusaHeads,
    load_medusa_heads,
)
from mlx_spec.drafters.mtp import MTPDrafter
from mlx_spec.models.dflash import dflash_for
from mlx_spec.models.eagle3 import eagle3_for
from mlx_spec.models.mtp import MTPModule, target_layers
from mlx_spec.training.config import DistillConfig
from mlx_spec.training.distiller import Distiller

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx_lm.utils import _get_classes


def target_text_config(target_dir: Path) -> dict:
    config = json.loads((target_dir / "config.json").read_text())
    return config


def student_config(target_config: dict, config: DistillConfig) -> dict:
    """A small llama-layout draft model with the target's vocabulary and context."""
    text = target_config.get("text_config", target_config)
    heads = max(1, config.hidden_size // 64)
    return {
        "model_type": "llama",
        "architectures": ["LlamaForCausalLM"],
        "hidden_size": config.hidden_size,
        "num_hidden_layers": config.num_layers,
        "intermediate_size": 4 * config.hidden_size,
        "num_attention_heads": heads,
        "num_key_value_heads": heads,
        "rms_norm_eps": 1e-5,
        "vocab_size": text["vocab_size"],
        "max_position_embeddings": text.get("max_position_embeddings", 4096),
        "rope_theta": 10000.0,
        "tie_word_embeddings": True,
        "bos_token_id": target_config.get("bos_token_id"),
        "eos_token_id": target_config.get("eos_token_id"),
    }


def build_student(
    target: nn.Module,
    target_config: dict,
    config: DistillConfig,
    init: Path | None = None,
    *,
    counts: np.ndarray | None = None,
    draft_vocab: int | None = None,
):
    """(student module, its config) for `config.kind`: freshly initialized, or the drafter
    in `init` (a directory `mlx-spec distill` or `mlx-spec convert` wrote) to train further.
    An EAGLE-3 head with `draft_vocab` drafts over the `draft_vocab` target tokens most
    frequent in `counts` (how often each token id occurs in the training text)."""
    mx.random.seed(config.seed)
    if init is not None:
        return load_student(target, target_config, config, init)
    if config.kind == "draft-model":
        student_cfg = student_config(target_config, config)
        model_cls, args_cls = _get_classes(student_cfg)
        return model_cls(args_cls.from_dict(student_cfg)), student_cfg
    if config.kind == "medusa":
        return medusa_student(target, config.heads), target_config
    if config.kind == "eagle3":
        vocab = None if draft_vocab is None else frequent_tokens(counts, draft_vocab)
        return eagle3_for(target, target_config, vocab), target_config
    if config.kind == "dflash":
        return dflash_for(target, target_config, config.num_layers), target_config
    text = target_config.get("text_config", target_config)
    layer = len(target_layers(target)) - 1  # the deepest layer: its kind, and a warm start
    module = MTPModule(config.mtp_family, target, layer, text.get("rms_norm_eps", 1e-6))
    return module, target_config


def frequent_tokens(counts: np.ndarray, size: int) -> np.ndarray:
    """The `size` token ids most frequent in `counts` (ties: lower id), ascending."""
    if not 0 < size <= counts.size:
        raise ValueError(f"--draft-vocab must be in 1 .. {counts.size}, got {size}")
    order = np.lexsort((np.arange(counts.size), -counts))
    return np.sort(order[:size])


def medusa_student(target: nn.Module, heads: int) -> MedusaHeads:
    """Medusa heads that start as the target's own output layer: every block's linear layer
    zero (so a block passes its input through) and each head's output a copy of the
    target's (as Medusa initializes them)."""
    head, _ = find_head(target)
    weight = head.weight  # lm_head, or the tied embedding
    if weight.dtype not in (mx.float32, mx.float16, mx.bfloat16):
        raise ValueError("distilling Medusa heads needs a target with unquantized output weights")
    vocab, hidden = weight.shape
    module = MedusaHeads(hidden, vocab, heads, 1)
    for one in module.heads:
        for block in one.blocks:
            block.linear.weight = mx.zeros_like(block.linear.weight)
            block.linear.bias = mx.zeros_like(block.linear.bias)
        one.out.weight = mx.array(weight.astype(mx.float32))
    return module


def load_student(target: nn.Module, target_config: dict, config: DistillConfig, init: Path):
    from mlx_spec.drafters.dflash import load_dflash_drafter
    from mlx_spec.drafters.eagle3 import load_eagle3_drafter
    from mlx_spec.drafters.mtp import load_mtp_drafter
    from mlx_spec.loading import load

    if config.kind == "medusa":
        module = load_medusa_heads(str(init))
        if module.num_heads != config.heads:
            raise ValueError(
                f"{init}: {module.num_heads} Medusa heads (pass --heads {module.num_heads})"
            )
        return module, target_config

    if config.kind == "eagle3":
        return load_eagle3_drafter(init, target).module, target_config
    if config.kind == "dflash":
        return load_dflash_drafter(init, target).model, target_config
    if config.kind == "mtp":
        module = load_mtp_drafter(init, target).module
        if module.family != config.mtp_family:
            raise ValueError(
                f"{init}: an MTP head in the {module.family} layout, not {config.mtp_family} "
                f"(pass --mtp-family {module.family})"
            )
        return module, target_config
    model, _ = load(str(init))
    return model, json.loads((init / "config.json").read_text())


def drafter_for(distiller: Distiller, tokenizer):
    """The trained student as a drafter, for measuring acceptance."""
    from mlx_spec.drafters.draft_model import DraftModelDrafter

    if distiller.config.kind == "mtp":
        return MTPDrafter(distiller.student, distiller.target)
    if distiller.config.kind == "eagle3":
        return Eagle3Drafter(distiller.student, distiller.target)
    if distiller.config.kind == "dflash":
        return DFlashDrafter(distiller.student, distiller.target)
    if distiller.config.kind == "medusa":
        return MedusaDrafter(distiller.student)
    return DraftModelDrafter(distiller.student, tokenizer)
