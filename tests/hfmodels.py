"""Tiny random Hugging Face checkpoints written with transformers + torch, for converter tests.

Each checkpoint is what `save_pretrained(safe_serialization=True)` writes (float32 safetensors,
config.json), plus the char-level tokenizer of `tinymodels`. Weights are redrawn at a large scale
(std 1/sqrt(fan-in), norms 1 +- 0.1) so logits are O(1) and a conversion mistake cannot hide in
near-uniform outputs. `add_mtp` appends multi-token-prediction tensors with the published names
and shapes of each family (see docs/drafters.md) as an extra shard.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import mlx_spec  # noqa: F401  (loads the BLAS before mlx)

import tinymodels as tm
import torch
from safetensors import safe_open
from safetensors.torch import save_file

VOCAB = tm.tokenizer_size()
INDEX_NAME = "model.safetensors.index.json"
MTP_SHARD = "model-mtp.safetensors"

# The 64-wide tiny transformer (shared with the conformance matrix's checkpoints): attention
# sizes, and the sizes of a mixture of experts.
TINY = dict(
    hidden_size=64,
    intermediate_size=128,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
)
TINY_EXPERTS = dict(moe_intermediate_size=32, n_routed_experts=4, num_experts_per_tok=2)

# Tiny configs for transformers' own config classes (model_type -> kwargs).
CONFIGS = {
    "glm4_moe": dict(
        **TINY,
        **TINY_EXPERTS,
        num_hidden_layers=2,
        first_k_dense_replace=1,  # layer 0 dense, layer 1 MoE
        partial_rotary_factor=0.5,
        n_shared_experts=1,
        tie_word_embeddings=False,
    ),
    "llama": dict(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
    ),
    "qwen3": dict(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        tie_word_embeddings=False,
    ),
    "gemma3_text": dict(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=3,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=16,
        query_pre_attn_scalar=16,
        sliding_window=4,  # smaller than the test sequences
    ),
    "deepseek_v3": dict(
        hidden_size=32,
        intermediate_size=64,
        moe_intermediate_size=32,
        num_hidden_layers=2,
        first_k_dense_replace=1,  # layer 0 dense, layer 1 MoE
        num_attention_heads=4,
        num_key_value_heads=4,
        n_routed_experts=4,
        num_experts_per_tok=2,
        n_shared_experts=1,
        n_group=1,
        topk_group=1,
        q_lora_rank=16,
        kv_lora_rank=16,
        qk_rope_head_dim=8,
        qk_nope_head_dim=8,
        v_head_dim=8,
        tie_word_embeddings=False,
    ),
    "qwen2": dict(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        tie_word_embeddings=False,
    ),
    # Qwen3.5 text model: layers 0-2 gated delta-net, layer 3 full attention.
    "qwen3_5_text": dict(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        linear_num_value_heads=4,
        linear_num_key_heads=2,
        linear_key_head_dim=8,
        linear_value_head_dim=8,
        linear_conv_kernel_dim=4,
        tie_word_embeddings=False,
    ),
}
# A tiny vision tower, so a Qwen3.5 checkpoint has the real (multimodal) layout.
QWEN3_5_VISION = dict(
    depth=1,
    hidden_size=32,
    intermediate_size=64,
    num_heads=2,
    out_hidden_size=32,
    patch_size=4,
    num_position_embeddings=16,
)


def tiny_config(model_type: str, **overrides):
    """transformers config object of `model_type` with the tiny sizes above."""
    from transformers import AutoConfig

    kwargs = {**CONFIGS[model_type], "vocab_size": VOCAB, **overrides}
    kwargs.setdefault("bos_token_id", tm.BOS_ID)
    kwargs.setdefault("eos_token_id", tm.EOS_ID)
    return AutoConfig.for_model(model_type, **kwargs)


@torch.no_grad()
def randomize(model: torch.nn.Module, seed: int) -> torch.nn.Module:
    """Redraw every floating tensor of the state dict: matrices ~ N(0, 1/fan_in), vectors +- 0.1."""
    gen = torch.Generator().manual_seed(seed)
    seen = set()
    for _, tensor in sorted(model.state_dict(keep_vars=True).items()):
        if not tensor.is_floating_point() or id(tensor) in seen:
            continue
        seen.add(id(tensor))
        noise = torch.randn(tensor.shape, generator=gen, dtype=torch.float32)
        if tensor.ndim >= 2:
            tensor.data.copy_(noise * tensor.shape[-1] ** -0.5)
        else:
            tensor.data.add_(0.1 * noise)
    return model.eval()


def write_tokenizer(path: Path) -> None:
    """tokenizer.json + tokenizer_config.json, as tinymodels.write_checkpoint writes them."""
    tm.write_tokenizer(path)


def save(model: torch.nn.Module, path: Path, max_shard_size: str | None = None) -> Path:
    """save_pretrained (safetensors; sharded with an index when max_shard_size is small)."""
    from transformers.utils import logging

    logging.disable_progress_bar()  # no "Writing model shards" bars in test output
    path = Path(path)
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(str(path), safe_serialization=True, **kwargs)
    write_tokenizer(path)
    return path


def write_hf_checkpoint(
    path: Path,
    model_type: str,
    *,
    seed: int = 0,
    max_shard_size: str | None = None,
    **overrides,
) -> tuple[Path, torch.nn.Module]:
    """A tiny random `model_type` causal LM saved at `path`; returns (path, the torch model)."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(
        tiny_config(model_type, **overrides), attn_implementation="eager"
    )
    randomize(model.float(), seed)
    return save(model, path, max_shard_size), model


def write_qwen3_5_checkpoint(
    path: Path, *, seed: int = 0, max_shard_size: str | None = None
) -> tuple[Path, torch.nn.Module]:
    """Qwen3.5 as published: Qwen3_5ForConditionalGeneration, `model.language_model.*` weights,
    a vision tower, and the text settings nested in `text_config`."""
    from transformers import Qwen3_5Config, Qwen3_5ForConditionalGeneration

    text = tiny_config("qwen3_5_text").to_dict()
    config = Qwen3_5Config(
        text_config=text, vision_config=QWEN3_5_VISION, tie_word_embeddings=False
    )
    torch.manual_seed(seed)
    model = Qwen3_5ForConditionalGeneration._from_config(config, attn_implementation="eager")
    randomize(model.float(), seed)
    return save(model, path, max_shard_size), model


def write_mimo_checkpoint(
    path: Path, *, seed: int = 0, max_shard_size: str | None = None
) -> tuple[Path, torch.nn.Module]:
    """A Qwen2 checkpoint relabelled as MiMo (transformers has no MiMo; its target is Qwen2)."""
    path, model = write_hf_checkpoint(path, "qwen2", seed=seed, max_shard_size=max_shard_size)
    edit_config(path, model_type="mimo", architectures=["MiMoForCausalLM"])
    return path, model


def text_config(config: dict) -> dict:
    """The text model's settings: `text_config` when the config nests one, else the config."""
    return config.get("text_config", config)


def edit_config(path: Path, nested: bool = False, **changes) -> dict:
    """Update config.json (its text_config when `nested` and there is one); returns it."""
    config = json.loads((Path(path) / "config.json").read_text())
    target = config.get("text_config", config) if nested else config
    target.update(changes)
    (Path(path) / "config.json").write_text(json.dumps(config, indent=2))
    return config


@torch.no_grad()
def hf_logits(model: torch.nn.Module, ids: list[int]):
    """transformers' float32 logits [len(ids), V] for one sequence, as a numpy array."""
    out = model(input_ids=torch.tensor([ids]), use_cache=False)
    return out.logits[0].float().numpy()


# --------------------------------------------------------------------------- checkpoint tensors


def weight_map(path: Path) -> dict[str, str]:
    """{tensor name: file} of a checkpoint, single file or sharded."""
    path = Path(path)
    if (path / INDEX_NAME).is_file():
        return json.loads((path / INDEX_NAME).read_text())["weight_map"]
    out = {}
    for file in sorted(path.glob("*.safetensors")):
        with safe_open(str(file), "pt") as f:
            out.update({name: file.name for name in f.keys()})
    return out


def read_tensors(path: Path, names=None) -> dict[str, torch.Tensor]:
    """Tensors of a checkpoint (all, or those in `names`) as torch tensors."""
    files: dict[str, list[str]] = {}
    for name, file in weight_map(path).items():
        if names is None or name in names:
            files.setdefault(file, []).append(name)
    out = {}
    for file, members in files.items():
        with safe_open(str(Path(path) / file), "pt") as f:
            out.update({name: f.get_tensor(name) for name in members})
    return out


def append_shard(path: Path, tensors: dict[str, torch.Tensor], shard: str = MTP_SHARD) -> None:
    """Add `tensors` to the checkpoint as a new shard; create or update the index."""
    path = Path(path)
    mapping = weight_map(path)
    clash = set(mapping) & set(tensors)
    assert not clash, f"tensors already in the checkpoint: {sorted(clash)[:3]}"
    tensors = {k: v.contiguous() for k, v in tensors.items()}
    save_file(tensors, str(path / shard), metadata={"format": "pt"})
    mapping.update({name: shard for name in tensors})
    total = sum(f.stat().st_size for f in path.glob("*.safetensors"))
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(mapping.items()))}
    (path / INDEX_NAME).write_text(json.dumps(index, indent=2))


# ------------------------------------------------------------------------------------ MTP layers

_LAYER = re.compile(r"^(.*layers)\.(\d+)\.(.+)$")


def _layer(shapes_from: dict[str, torch.Tensor], prefix: str, index: int) -> dict[str, tuple]:
    """{suffix: shape} of decoder layer `index` under `prefix` (e.g. 'model.layers')."""
    out = {}
    for name, value in shapes_from.items():
        m = _LAYER.match(name)
        if m and m.group(1) == prefix and int(m.group(2)) == index:
            out[m.group(3)] = tuple(value.shape)
    assert out, f"no layer {prefix}.{index}"
    return out


def _draw(shapes: dict[str, tuple], gen: torch.Generator) -> dict[str, torch.Tensor]:
    """Random tensors; norms around 0.1 (not 0 or 1, so a convention change is visible)."""
    out = {}
    for name, shape in shapes.items():
        noise = torch.randn(shape, generator=gen, dtype=torch.float32)
        if len(shape) >= 2:
            out[name] = noise * shape[-1] ** -0.5
        elif name.endswith("norm.weight") or "norm_" in name:
            out[name] = 0.1 + 0.05 * noise
        else:
            out[name] = 0.1 * noise
    return out


def add_mtp(
    path: Path,
    family: str,
    *,
    num_layers: int = 1,
    seed: int = 100,
    own_copies: bool = False,
) -> dict[str, torch.Tensor]:
    """Append MTP tensors of `family` (deepseek_v3 | qwen3_5 | mimo) to the checkpoint at `path`
    and declare them in its config; returns the tensors added, by checkpoint name.

    DeepSeek layers copy the target's last layer (an MoE layer when it has one) and carry
    `embed_tokens` / `shared_head.head` copies of the target's (perturbed when `own_copies`).
    Qwen3.5 copies a full-attention layer; MiMo a Qwen2 layer.
    """
    path = Path(path)
    config = json.loads((path / "config.json").read_text())
    text = config.get("text_config", config)
    hidden, n_layers = text["hidden_size"], text["num_hidden_layers"]
    target = read_tensors(path)
    gen = torch.Generator().manual_seed(seed)
    added: dict[str, torch.Tensor] = {}
    if family == "deepseek_v3":
        layer = _layer(target, "model.layers", n_layers - 1)
        for i in range(num_layers):
            prefix = f"model.layers.{n_layers + i}"
            shapes = {
                **layer,
                "enorm.weight": (hidden,),
                "hnorm.weight": (hidden,),
                "eh_proj.weight": (hidden, 2 * hidden),
                "shared_head.norm.weight": (hidden,),
            }
            added.update({f"{prefix}.{k}": v for k, v in _draw(shapes, gen).items()})
            embed = target["model.embed_tokens.weight"].clone()
            head = target["lm_head.weight"].clone()
            if own_copies:
                embed = embed + 0.01 * torch.randn(embed.shape, generator=gen)
                head = head + 0.01 * torch.randn(head.shape, generator=gen)
            added[f"{prefix}.embed_tokens.weight"] = embed
            added[f"{prefix}.shared_head.head.weight"] = head
        edit_config(path, num_nextn_predict_layers=num_layers)
    elif family == "qwen3_5":
        layer_types = text["layer_types"]
        full = max(i for i, kind in enumerate(layer_types) if kind == "full_attention")
        prefix = "model.language_model.layers" if "text_config" in config else "model.layers"
        layer = _layer(target, prefix, full)
        shapes = {
            "fc.weight": (hidden, 2 * hidden),
            "pre_fc_norm_embedding.weight": (hidden,),
            "pre_fc_norm_hidden.weight": (hidden,),
            "norm.weight": (hidden,),
        }
        for i in range(num_layers):
            shapes.update({f"layers.{i}.{k}": v for k, v in layer.items()})
        added.update({f"mtp.{k}": v for k, v in _draw(shapes, gen).items()})
        edit_config(path, nested=True, mtp_num_hidden_layers=num_layers)
    elif family == "mimo":
        layer = _layer(target, "model.layers", n_layers - 1)
        for i in range(num_layers):
            shapes = {
                **layer,
                "token_layernorm.weight": (hidden,),
                "hidden_layernorm.weight": (hidden,),
                "input_proj.weight": (hidden, 2 * hidden),
                "final_layernorm.weight": (hidden,),
            }
            added.update({f"model.mtp_layers.{i}.{k}": v for k, v in _draw(shapes, gen).items()})
        edit_config(path, num_nextn_predict_layers=num_layers)
    else:
        raise ValueError(f"unknown MTP family {family}")
    append_shard(path, added)
    return added
