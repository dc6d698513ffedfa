"""GGUF files (llama.cpp's format, as LM Studio and Ollama keep models) -> MLX model directories.

Tensors: Q4_0, Q4_1 and Q8_0 stay quantized, repacked into MLX's affine layout (group 32) with
the same integers and scales, so they dequantize to exactly what llama.cpp computes; F32, F16
and BF16 stay as they are; every other type (K-quants, IQ types, Q5_0, ...) is dequantized to
float16. `dtype` turns every tensor, quantized ones included, into that float type. The
tokenizer is rebuilt from the metadata (`convert.gguf_tokenizer`).

llama.cpp's converter stores the query and key rows of llama-family models permuted for its
interleaved rotary embedding; they are put back in Hugging Face's order here, so the output runs
on mlx-lm's llama with its usual rotary (quantized rows move whole: groups run along a row).
"""

from __future__ import annotations

import json
import re
import sys
from dataclasses import dataclass
from pathlib import Path

from convert.errors import ConversionError
from convert.gguf_tokenizer import write_tokenizer

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx.utils import tree_flatten

GROUP = 32  # the block size of Q4_0, Q4_1 and Q8_0
KEPT = ("Q4_0", "Q4_1", "Q8_0")  # kept quantized
FLOATS = {"F32": mx.float32, "F16": mx.float16, "BF16": mx.bfloat16}
ARCHITECTURES = ("llama", "mistral3", "qwen2", "qwen3")  # GGUF architecture names taken
PERMUTED = ("llama", "mistral3")  # query/key rows stored in llama.cpp's rotary order
HF_CLASSES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}

# llama.cpp tensor name (blk.N. stripped) -> Hugging Face name (model.layers.N. stripped)
LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_output.weight": "self_attn.o_proj.weight",
    "attn_output.bias": "self_attn.o_proj.bias",
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
# metadata key (after "<arch>.") -> config key
CONFIG_KEYS = {
    "embedding_length": "hidden_size",
    "feed_forward_length": "intermediate_size",
    "block_count": "num_hidden_layers",
    "attention.head_count": "num_attention_heads",
    "attention.head_count_kv": "num_key_value_heads",
    "attention.layer_norm_rms_epsilon": "rms_norm_eps",
    "attention.key_length": "head_dim",
    "rope.freq_base": "rope_theta",
    "context_length": "max_position_embeddings",
}
_LAYER = re.compile(r"^blk\.(\d+)\.(.+)$")


def _log(message: str) -> None:
    print(f"[convert] {message}", file=sys.stderr, flush=True)


@dataclass
class GGUFTensor:
    name: str  # llama.cpp's name
    kind: str  # GGML type name: F32, Q4_0, Q6_K, ...
    shape: tuple[int, ...]  # logical shape, outermost first (Hugging Face order)
    data: np.ndarray  # the raw tensor as the reader maps it


@dataclass
class GGUFFile:
    path: Path
    metadata: dict
    tensors: dict[str, GGUFTensor]

    @property
    def architecture(self) -> str:
        return self.metadata.get("general.architecture", "?")


def is_gguf(path: Path) -> bool:
    """A file that starts with GGUF's magic."""
    try:
        with open(path, "rb") as f:
            return f.read(4) == b"GGUF"
    except OSError:
        return False


def read_gguf(path: Path) -> GGUFFile:
    """The metadata and tensors of a GGUF file (memory-mapped); a file that is not GGUF, is
    cut short or is corrupt is refused with the reason."""
    from gguf import GGUFReader

    if not is_gguf(path):
        raise ConversionError(f"{path}: not a GGUF file (no GGUF magic)")
    try:
        reader = GGUFReader(path)
    except (ValueError, KeyError, IndexError, TypeError, OverflowError, MemoryError) as exc:
        raise ConversionError(f"{path}: truncated or corrupt GGUF file ({exc})") from exc
    metadata = {}
    for key, field in reader.fields.items():
        if not key.startswith("GGUF."):
            metadata[key] = field.contents()
    tensors = {}
    for t in reader.tensors:
        shape = tuple(int(n) for n in reversed(t.shape.tolist()))
        tensors[t.name] = GGUFTensor(t.name, t.tensor_type.name, shape, t.data)
    _check_sizes(path, reader)
    return GGUFFile(path, metadata, tensors)


def _check_sizes(path: Path, reader) -> None:
    """Every tensor's bytes lie inside the file (the reader maps views without checking the
    last one ends before the end of the file on every numpy version)."""
    size = path.stat().st_size
    for t in reader.tensors:
        if t.data_offset + t.n_bytes > size:
            raise ConversionError(
                f"{path}: truncated: tensor {t.name} ends at byte {t.data_offset + t.n_bytes}, "
                f"the file has {size}"
            )


def _meta(file: GGUFFile, key: str, default=None):
    value = file.metadata.get(f"{file.architecture}.{key}", default)
    return value


def gguf_config(file: GGUFFile) -> dict:
    """The Hugging Face config.json the file's metadata describes (llama, qwen2, qwen3)."""
    arch = file.architecture
    if arch not in ARCHITECTURES:
        raise ConversionError(
            f"{file.path.name}: GGUF architecture {arch!r} is not converted (taken: "
            f"{', '.join(ARCHITECTURES)})"
        )
    if _meta(file, "expert_count", 0):
        raise ConversionError(
            f"{file.path.name}: a mixture-of-experts {arch} ({_meta(file, 'expert_count')} "
            "experts) is not converted from GGUF"
        )
    model_type = {"mistral3": "llama"}.get(arch, arch)
    config: dict = {"model_type": model_type, "architectures": [HF_CLASSES[model_type]]}
    for key, name in CONFIG_KEYS.items():
        value = _meta(file, key)
        if isinstance(value, list):
            raise ConversionError(f"{file.path.name}: {arch}.{key} varies by layer: not converted")
        if value is not None:
            config[name] = _plain(value)
    for key in ("hidden_size", "num_hidden_layers", "num_attention_heads"):
        if key not in config:
            raise ConversionError(f"{file.path.name}: metadata has no {key} ({arch}.*)")
    config.setdefault("num_key_value_heads", config["num_attention_heads"])
    config.setdefault("rope_theta", 10000.0)
    head_dim = config.get("head_dim", config["hidden_size"] // config["num_attention_heads"])
    rotary = _meta(file, "rope.dimension_count", head_dim)
    if rotary != head_dim:
        raise ConversionError(
            f"{file.path.name}: rotary embedding over {rotary} of {head_dim} head dimensions: "
            "not converted"
        )
    config["rope_scaling"] = _rope_scaling(file)
    embed = file.tensors.get("token_embd.weight")
    if embed is None:
        raise ConversionError(f"{file.path.name}: no token_embd.weight tensor")
    config["vocab_size"] = embed.shape[0]
    config["tie_word_embeddings"] = "output.weight" not in file.tensors
    config["attention_bias"] = "blk.0.attn_q.bias" in file.tensors
    for key, name in (("bos_token_id", "bos"), ("eos_token_id", "eos")):
        value = file.metadata.get(f"tokenizer.ggml.{name}_token_id")
        if value is not None:
            config[key] = int(value)
    return config


def _plain(value):
    """A metadata number as Python's: float32 values by their shortest spelling (1e-05, not
    9.999999747378752e-06)."""
    if isinstance(value, (np.floating, float)):
        return float(str(np.float32(value)))
    return value.item() if hasattr(value, "item") else value


def _rope_scaling(file: GGUFFile) -> dict | None:
    kind = _meta(file, "rope.scaling.type", "none")
    if "rope_freqs.weight" in file.tensors:
        raise ConversionError(
            f"{file.path.name}: rotary frequencies given as a tensor (Llama 3.1's scaling): "
            "not converted"
        )
    if kind in ("none", None):
        return None
    factor = float(_meta(file, "rope.scaling.factor", 1.0))
    if kind == "linear":
        return {"type": "linear", "rope_type": "linear", "factor": factor}
    if kind == "yarn":
        original = _meta(file, "rope.scaling.original_context_length")
        return {
            "type": "yarn",
            "rope_type": "yarn",
            "factor": factor,
            "original_max_position_embeddings": int(original),
        }
    raise ConversionError(f"{file.path.name}: rope scaling {kind!r} is not converted")


def hf_name(name: str, layers: int) -> str:
    """The Hugging Face name of llama.cpp tensor `name`; unknown names are refused."""
    if name in GLOBAL_NAMES:
        return GLOBAL_NAMES[name]
    match = _LAYER.match(name)
    if match and int(match.group(1)) < layers and match.group(2) in LAYER_NAMES:
        return f"model.layers.{match.group(1)}.{LAYER_NAMES[match.group(2)]}"
    raise ConversionError(f"unknown GGUF tensor {name}")


# ---------------------------------------------------------------------------------- tensors


def affine_from_blocks(data: np.ndarray, kind: str, shape: tuple[int, ...]):
    """(packed uint32 weight, scales, biases, bits) in MLX's affine layout for Q4_0, Q4_1 or
    Q8_0 blocks `data` ([rows, bytes per row] uint8) of a [rows, cols] tensor: MLX's value
    q * scale + bias equals llama.cpp's for every element."""
    rows, cols = shape
    blocks = np.ascontiguousarray(data).reshape(rows, cols // GROUP, -1)  # [rows, groups, bytes]
    d = blocks[..., :2].copy().view(np.float16)[..., 0]  # [rows, groups]
    if kind == "Q8_0":
        q = blocks[..., 2:].view(np.int8).astype(np.int16) + 128  # [rows, groups, 32] in 0..255
        return _pack(q, 8), d, (-128 * d.astype(np.float32)).astype(np.float16), 8
    start = 2 if kind == "Q4_0" else 4
    nibbles = blocks[..., start : start + GROUP // 2]  # [rows, groups, 16]
    # element j of a block is the low nibble of byte j, element j + 16 the high one
    q = np.concatenate([nibbles & 0x0F, nibbles >> 4], axis=-1)  # [rows, groups, 32]
    if kind == "Q4_0":
        return _pack(q, 4), d, (-8 * d.astype(np.float32)).astype(np.float16), 4
    m = blocks[..., 2:4].copy().view(np.float16)[..., 0]
    return _pack(q, 4), d, m, 4


def _pack(q: np.ndarray, bits: int) -> np.ndarray:
    """Integers `[rows, groups, 32]` packed into uint32 words, the first in the low bits."""
    rows = q.shape[0]
    per_word = 32 // bits
    words = q.reshape(rows, -1, per_word).astype(np.uint32)
    shifts = (np.arange(per_word, dtype=np.uint32) * bits)[None, None, :]
    return np.bitwise_or.reduce(words << shifts, axis=-1).astype(np.uint32)


def _unpermute(x, heads: int):
    """Rows of a query/key projection back from llama.cpp's rotary order: each head's rows
    [pairs (even, odd) interleaved] -> [evens then odds], as Hugging Face's llama has them."""
    rows = x.shape[0]
    rest = x.shape[1:]
    return x.reshape(heads, rows // heads // 2, 2, *rest).swapaxes(1, 2).reshape(rows, *rest)


def _float_array(t: GGUFTensor) -> mx.array:
    """A float tensor as MLX holds it: F32/F16/BF16 as they are, other types dequantized."""
    from gguf import GGMLQuantizationType, quants

    if t.kind in ("F32", "F16"):
        return mx.array(np.asarray(t.data).reshape(t.shape))
    values = quants.dequantize(np.asarray(t.data), GGMLQuantizationType[t.kind])
    values = mx.array(values.reshape(t.shape).astype(np.float32))
    return values.astype(mx.bfloat16) if t.kind == "BF16" else values


def _supported(t: GGUFTensor) -> None:
    from gguf import GGMLQuantizationType, quants

    if t.kind in FLOATS or t.kind in KEPT:
        return
    kind = GGMLQuantizationType[t.kind]
    if kind not in quants._type_traits:  # no dequantizer in the gguf package for it
        raise ConversionError(f"tensor {t.name}: GGML type {t.kind} cannot be read")


@dataclass
class Tensors:
    weights: dict[str, mx.array]  # Hugging Face names (+ .scales / .biases of quantized ones)
    quantized: dict[str, int]  # module path -> bits, for modules kept quantized
    dequantized: dict[str, int]  # GGML type -> tensors dequantized


def gguf_tensors(file: GGUFFile, config: dict, dtype: str | None = None) -> Tensors:
    """Every tensor under its Hugging Face name: quantized types kept (unless `dtype`),
    floats as they are (or cast to `dtype`), the rest dequantized to float16 (or `dtype`)."""
    layers = config["num_hidden_layers"]
    heads = {"q_proj": config["num_attention_heads"], "k_proj": config["num_key_value_heads"]}
    permuted = file.architecture in PERMUTED
    out = Tensors({}, {}, {})
    for t in file.tensors.values():
        name = hf_name(t.name, layers)
        _check_shape(t)
        _supported(t)
        proj = name.split(".")[-2]
        heads_of = heads.get(proj) if permuted else None
        if t.kind in KEPT and dtype is None and len(t.shape) == 2:
            w, scales, biases, bits = affine_from_blocks(t.data, t.kind, t.shape)
            arrays = {"weight": w, "scales": scales, "biases": biases}
            module = name.rsplit(".", 1)[0]
            for key, value in arrays.items():
                value = _unpermute(value, heads_of) if heads_of else value
                out.weights[f"{module}.{key}"] = mx.array(value)
            out.quantized[module] = bits
            continue
        value = _float_array(t)
        if t.kind not in FLOATS:
            out.dequantized[t.kind] = out.dequantized.get(t.kind, 0) + 1
            value = value.astype(mx.float16 if dtype is None else getattr(mx, dtype))
        elif dtype is not None:
            value = value.astype(getattr(mx, dtype))
        out.weights[name] = _unpermute(value, heads_of) if heads_of else value
    return out


def _check_shape(t: GGUFTensor) -> None:
    if t.kind in KEPT and len(t.shape) == 2 and t.shape[1] % GROUP:
        raise ConversionError(f"tensor {t.name}: {t.shape[1]} columns: not whole blocks of 32")


# ------------------------------------------------------------------------------------ model


def build_model(config: dict, tensors: Tensors) -> nn.Module:
    """mlx-lm's model of `config` holding `tensors`, the quantized modules quantized as given;
    every name and shape is checked against the model."""
    from convert.classes import model_classes

    model_cls, args_cls = model_classes(config)
    try:
        model = model_cls(args_cls.from_dict(config))
    except (TypeError, KeyError, ValueError) as exc:
        raise ConversionError(
            f"the GGUF metadata does not fit {config['model_type']}: {exc}"
        ) from exc
    if tensors.quantized:
        nn.quantize(
            model,
            group_size=GROUP,
            bits=4,
            class_predicate=lambda path, _: (
                {"group_size": GROUP, "bits": tensors.quantized[path]}
                if path in tensors.quantized
                else False
            ),
        )
    weights = dict(tensors.weights)
    if hasattr(model, "sanitize"):
        weights = model.sanitize(weights)
    expected = dict(tree_flatten(model.parameters()))
    for name in sorted(set(weights) - set(expected)):
        raise ConversionError(f"tensor {name} has no place in mlx-lm's {config['model_type']}")
    for name in sorted(set(expected) - set(weights)):
        raise ConversionError(f"tensor {name} is missing from the GGUF file")
    for name, value in weights.items():
        if tuple(value.shape) != tuple(expected[name].shape):
            raise ConversionError(
                f"tensor {name} has shape {list(value.shape)}, the metadata implies "
                f"{list(expected[name].shape)}"
            )
    model.load_weights(list(weights.items()), strict=True)
    mx.eval(model.parameters())
    return model


def quantization_config(quantized: dict[str, int]) -> dict | None:
    """The `quantization` entry of config.json: the most common bit width, per-module entries
    for the others (mlx-lm reads both)."""
    if not quantized:
        return None
    widths = list(quantized.values())
    common = max(set(widths), key=widths.count)
    entry: dict = {"group_size": GROUP, "bits": common, "mode": "affine"}
    for path, bits in sorted(quantized.items()):
        if bits != common:
            entry[path] = {"group_size": GROUP, "bits": bits}
    return entry


def convert_gguf(path: Path, out: Path, dtype: str | None, quantization) -> dict:
    """Write the MLX model of GGUF file `path` into directory `out` (which exists and is
    empty); returns what conversion.json records about it."""
    from mlx_lm.utils import quantize_model, save_config, save_model

    file = read_gguf(path)
    config = gguf_config(file)
    _log(f"{path.name}: {file.architecture}, {len(file.tensors)} tensors")
    tensors = gguf_tensors(file, config, dtype)
    if tensors.dequantized:
        kinds = ", ".join(f"{k} ({n})" for k, n in sorted(tensors.dequantized.items()))
        _log(f"dequantized to {dtype or 'float16'}: {kinds}")
    model = build_model(config, tensors)
    quant = quantization_config(tensors.quantized)
    if quant is not None:
        config["quantization"] = config["quantization_config"] = quant
    if quantization is not None:
        if quant is not None:
            raise ConversionError(
                "the file's Q4_0/Q4_1/Q8_0 tensors are kept quantized: add --dtype to "
                "dequantize them before quantizing again"
            )
        model, config = quantize_model(model, config, quantization.group_size, quantization.bits)
    save_model(out, model, donate_model=True)
    save_config(config, config_path=out / "config.json")
    tokenizer = write_tokenizer(file, out)
    kinds: dict[str, int] = {}
    for t in file.tensors.values():
        kinds[t.kind] = kinds.get(t.kind, 0) + 1
    return {
        "gguf": {
            "file": path.name,
            "architecture": file.architecture,
            "tensor_types": kinds,
            "kept_quantized": len(tensors.quantized),
            "dequantized": tensors.dequantized,
            "rotary_rows_unpermuted": file.architecture in PERMUTED,
            "tokenizer": tokenizer,
            "metadata": _plain_metadata(file.metadata),
        }
    }


def _plain_metadata(metadata: dict) -> dict:
    """The metadata for conversion.json, without the long tokenizer arrays."""
    out = {}
    for key, value in metadata.items():
        if key in (
            "tokenizer.ggml.tokens",
            "tokenizer.ggml.merges",
            "tokenizer.ggml.scores",
            "tokenizer.ggml.token_type",
            "tokenizer.chat_template",
        ):
            out[key] = f"<{len(value)} entries>" if isinstance(value, list) else "<text>"
            continue
        if hasattr(value, "tolist"):
            value = value.tolist()
        try:
            json.dumps(value)
        except TypeError:
            value = repr(value)
        out[key] = value
    return out
