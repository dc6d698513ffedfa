"""Multi-token-prediction (MTP) layers: find them in a checkpoint, fix conventions, check shapes.

mlx-lm deletes these weights when it loads a target, so they are split off here, before the
target's own sanitizing. Layouts (T = hidden size, V = vocabulary):

- DeepSeek-V3 / GLM-4.5+: `model.layers.{L+i}.{enorm, hnorm, eh_proj, shared_head.*, <layer>}`
  where L = num_hidden_layers; `embed_tokens` and `shared_head.head` copy the target's.
- Qwen3.5 / Qwen3-Next: `mtp.{fc, pre_fc_norm_embedding, pre_fc_norm_hidden, norm, layers.i.*}`;
  every norm is stored as w and computes x*(1+w), so 1 is added here (stored as x*w).
- MiMo: `model.mtp_layers.{i}.{token_layernorm, hidden_layernorm, input_proj, final_layernorm,
  <layer>}`; the hidden state comes first in the concat.

The drafter directory keeps each family's names under `layers.{i}.` (Qwen: under the `mtp.`
root), in x*w convention, and refers to the target for the embedding and output head.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from convert.errors import ConversionError

import mlx.core as mx


@dataclass(frozen=True)
class Family:
    name: str
    pattern: re.Pattern  # groups: (layer index or None, suffix)
    head_shapes: dict  # suffix -> shape as a function of (T, V)
    shared: tuple  # suffixes that duplicate the target's embedding / head
    count_keys: tuple  # config keys declaring the number of MTP layers
    add_one_to_norms: bool = False
    layer_offset_from_config: bool = False  # DeepSeek: layer index counts from num_hidden_layers


_T = "T"
_2T = "2T"
_V = "V"

DEEPSEEK = Family(
    name="deepseek_v3",
    pattern=re.compile(r"^model\.layers\.(\d+)\.(.+)$"),
    head_shapes={
        "enorm.weight": (_T,),
        "hnorm.weight": (_T,),
        "eh_proj.weight": (_T, _2T),
        "shared_head.norm.weight": (_T,),
        "shared_head.head.weight": (_V, _T),
        "embed_tokens.weight": (_V, _T),
    },
    shared=("shared_head.head.weight", "embed_tokens.weight"),
    count_keys=("num_nextn_predict_layers",),
    layer_offset_from_config=True,
)
QWEN = Family(
    name="qwen3_5",
    pattern=re.compile(r"^mtp\.(?:layers\.(\d+)\.)?(.+)$"),
    head_shapes={
        "fc.weight": (_T, _2T),
        "pre_fc_norm_embedding.weight": (_T,),
        "pre_fc_norm_hidden.weight": (_T,),
        "norm.weight": (_T,),
    },
    shared=(),
    count_keys=("mtp_num_hidden_layers", "num_nextn_predict_layers"),
    add_one_to_norms=True,
)
MIMO = Family(
    name="mimo",
    pattern=re.compile(r"^model\.mtp_layers\.(\d+)\.(.+)$"),
    head_shapes={
        "token_layernorm.weight": (_T,),
        "hidden_layernorm.weight": (_T,),
        "input_proj.weight": (_T, _2T),
        "final_layernorm.weight": (_T,),
    },
    shared=(),
    count_keys=("num_nextn_predict_layers",),
)

FAMILIES = {
    "deepseek_v3": DEEPSEEK,
    "deepseek_v32": DEEPSEEK,
    "glm4_moe": DEEPSEEK,
    "glm4_moe_lite": DEEPSEEK,
    "qwen3_5": QWEN,
    "qwen3_5_text": QWEN,
    "qwen3_5_moe": QWEN,
    "qwen3_next": QWEN,
    "mimo": MIMO,
}
_LAYER_TENSOR = re.compile(r"layers\.(\d+)\.(.+)$")


def text_config(config: dict) -> dict:
    return config.get("text_config", config)


def declared_layers(config: dict, family: Family) -> int:
    text = text_config(config)
    for key in family.count_keys:
        for source in (text, config):
            if isinstance(source.get(key), int):
                return source[key]
    return 0


@dataclass
class MTPTensors:
    """MTP tensors split from a checkpoint, named as in the drafter directory."""

    family: Family
    num_layers: int
    tensors: dict  # drafter name -> array
    shared_copies: dict  # drafter name -> array (copies of the target's embedding/head)


def _match(family: Family, name: str, config: dict) -> tuple[int, str] | None:
    m = family.pattern.match(name)
    if not m:
        return None
    index, suffix = m.group(1), m.group(2)
    if family.layer_offset_from_config:
        index = int(index) - text_config(config)["num_hidden_layers"]
        return (index, suffix) if index >= 0 else None
    if family is QWEN and index is None:
        return (-1, suffix)  # a head tensor shared by all MTP layers
    return int(index), suffix


def _drafter_name(family: Family, index: int, suffix: str) -> str:
    if family is QWEN:
        return suffix if index < 0 else f"layers.{index}.{suffix}"
    return f"layers.{index}.{suffix}"


def split_mtp(config: dict, shapes: dict[str, tuple]) -> dict[str, tuple[int, str]]:
    """{checkpoint name: (mtp layer, suffix)} for every MTP tensor; empty if the family has none."""
    family = FAMILIES.get(config.get("model_type"))
    if family is None:
        return {}
    return {n: hit for n in shapes if (hit := _match(family, n, config)) is not None}


def _layer_shapes(shapes: dict[str, tuple], mtp_names) -> dict[str, tuple]:
    """Shape of each decoder-layer suffix in the target (its deepest layer that has it)."""
    best: dict[str, tuple[int, tuple]] = {}
    for name, shape in shapes.items():
        if name in mtp_names:
            continue
        m = _LAYER_TENSOR.search(name)
        if m and int(m.group(1)) >= best.get(m.group(2), (-1, None))[0]:
            best[m.group(2)] = (int(m.group(1)), shape)
    return {suffix: shape for suffix, (_, shape) in best.items()}


def _expected_head_shape(spec: tuple, config: dict) -> tuple:
    text = text_config(config)
    sizes = {_T: text["hidden_size"], _2T: 2 * text["hidden_size"], _V: text["vocab_size"]}
    return tuple(sizes[s] for s in spec)


def check_mtp_shapes(config: dict, shapes: dict[str, tuple], mtp: dict[str, tuple]) -> int:
    """Refuse unknown MTP tensors and wrong shapes; returns the number of MTP layers."""
    family = FAMILIES[config["model_type"]]
    layer_shapes = _layer_shapes(shapes, mtp)
    for name, (_, suffix) in sorted(mtp.items()):
        if suffix in family.head_shapes:
            want = _expected_head_shape(family.head_shapes[suffix], config)
        elif suffix in layer_shapes:
            want = layer_shapes[suffix]  # a decoder layer of the target's own kind
        else:
            raise ConversionError(f"unknown MTP tensor {name} for {family.name}-style MTP")
        if tuple(shapes[name]) != tuple(want):
            raise ConversionError(
                f"MTP tensor {name} has shape {list(shapes[name])}, expected {list(want)}"
            )
    layers = sorted({i for i, _ in mtp.values() if i >= 0})
    if layers != list(range(len(layers))):
        raise ConversionError(f"MTP layers {layers} are not numbered 0..n-1")
    declared = declared_layers(config, family)
    if declared and declared != len(layers):
        raise ConversionError(
            f"config declares {declared} MTP layer(s) but the checkpoint has {len(layers)}"
        )
    _require_head(family, mtp, len(layers))
    return len(layers)


def _require_head(family: Family, mtp: dict, num_layers: int) -> None:
    present = {(i, s) for i, s in mtp.values()}
    for suffix in family.head_shapes:
        if suffix in family.shared:
            continue
        layers = [-1] if family is QWEN else range(num_layers)
        for i in layers:
            if (i, suffix) not in present:
                where = "mtp." if i < 0 else f"MTP layer {i}"
                raise ConversionError(f"{where} lacks {suffix}")


def _is_norm(suffix: str) -> bool:
    """pre_fc_norm_*, norm, input/post_attention_layernorm, q_norm, k_norm (module names)."""
    parts = suffix.split(".")
    return len(parts) >= 2 and parts[-1] == "weight" and "norm" in parts[-2]


def extract_mtp(config: dict, weights: dict[str, mx.array], mtp: dict, num_layers: int):
    """Pop the MTP tensors out of `weights`, renamed and convention-fixed."""
    family = FAMILIES[config["model_type"]]
    tensors, shared = {}, {}
    for name, (index, suffix) in mtp.items():
        value = weights.pop(name)
        target = shared if suffix in family.shared else tensors
        if family.add_one_to_norms and _is_norm(suffix):
            value = value + 1  # Qwen stores w and computes x*(1+w)
        target[_drafter_name(family, index, suffix)] = value
    return MTPTensors(family, num_layers, tensors, shared)
