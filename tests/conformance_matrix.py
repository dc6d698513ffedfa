"""Conformance matrix: every model family that both transformers and mlx-lm implement, converted
by `convert_checkpoint` and compared with transformers' logits.

For each family a tiny random checkpoint is written by transformers' own `save_pretrained`
(sharded safetensors), built from the family's config class defaults with the size attributes
shrunk (and a sliding window of 8 where the family has one), its weights redrawn at O(1) scale.
It is converted to float32, loaded with `mlx_spec.load`, and its logits on a 20-token sequence are
compared with transformers' twice: one pass through a fresh cache, and a chunked pass (a prefill
then chunks of 1-4 tokens, as speculative verification feeds it). A family is

  exact     every logit within ATOL of transformers' (in both passes);
  refused   conversion or loading refused it with a one-line reason before any decoding;
  skipped   transformers cannot build or run it here (the reason says why), so nothing is compared;
  MISMATCH  converted and loaded, but its logits differ: a silent divergence (the target is none).

`python benchmarks/conformance.py` prints the matrix; `tests/test_conformance.py` runs a slice.
"""

from __future__ import annotations

import dataclasses
import json
import os
import pkgutil
import shutil
import tempfile
import time
import traceback
import warnings
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import mlx_spec
from convert import ConversionError, Quantization, convert_checkpoint

import hfmodels as hfm
import mlx.core as mx
import numpy as np
import tinymodels as tm
import torch

ATOL = 1e-4
SEQ_LEN = 20
WINDOW = 8  # sliding window of the tiny checkpoints: the sequence runs well past it
CHUNKS = (7, 1, 4, 1, 3, 2, 2)  # the chunked pass: a prefill, then verification-sized chunks
SHARD = "100KB"  # small enough that every checkpoint is sharded with an index

# Quantized conversions are compared with the float32 conversion of the same checkpoint: the
# relative error ||q - f|| / ||f|| of the logits. Affine quantization rounds each weight to within
# half a step of range/15 (4 bits) or range/255 (8 bits), so the 4-bit error should be about 17x
# the 8-bit one; through four random (untrained, hence error-amplifying) layers it measures
# 0.014-0.025 at 8 bits and 0.2-0.42 at 4 bits. The bounds leave about 2x (8 bits) and 1.5x
# (4 bits) headroom: a quantization that lost a tensor, or scales, would be far outside them.
QUANT_BOUNDS = {8: 0.05, 4: 0.6}
QUANT_FAMILIES = ("llama", "qwen3", "gemma2", "qwen3_moe")

# Sizes of the tiny checkpoints, set wherever the family's config class has the attribute
# (aliases in the class's attribute_map included). Everything else keeps the class default.
SIZES = dict(
    **hfm.TINY,
    ffn_hidden_size=128,
    num_hidden_layers=4,
    max_position_embeddings=256,
    sliding_window=WINDOW,
    # mixture of experts
    **hfm.TINY_EXPERTS,
    shared_expert_intermediate_size=32,
    expert_intermediate_size=32,
    num_local_experts=4,
    num_experts=4,
    moe_num_experts=4,
    moe_k=2,
    moe_topk=2,
    n_group=1,
    topk_group=1,
    # multi-head latent attention
    q_lora_rank=16,
    kv_lora_rank=16,
    qk_rope_head_dim=8,
    qk_nope_head_dim=8,
    qk_head_dim=16,
    v_head_dim=16,
    # linear attention / state-space layers
    linear_num_value_heads=4,
    linear_num_key_heads=2,
    linear_key_head_dim=16,
    linear_value_head_dim=16,
    mamba_n_heads=4,
    mamba_d_head=16,
    mamba_d_state=16,
    state_size=16,
    ssm_state_size=16,
    n_groups=1,
    # vision towers of multimodal checkpoints (the text model is what is compared)
    image_size=32,
    patch_size=8,
    num_channels=3,
    vision_output_dim=64,
    out_hidden_size=64,
    # special tokens inside the tiny vocabulary
    bos_token_id=tm.BOS_ID,
    eos_token_id=tm.EOS_ID,
    pad_token_id=0,
)

# Families whose defaults need more than SIZES (model_type -> config kwargs).
OVERRIDES: dict[str, dict] = {
    # a full-attention layer after five sliding ones, as the published models have
    "gemma3_text": dict(num_hidden_layers=6),
    "gemma3": dict(text_config=dict(num_hidden_layers=6)),
    # Phi-3.5-MoE's published config has biases transformers' defaults leave out; mlx-lm's
    # PhiMoE always has them (a checkpoint without them is refused: the tensors are missing)
    "phimoe": dict(attention_bias=True, lm_head_bias=True),
    # short-convolution layers between attention ones, as LFM2 has (transformers' default is
    # attention on every layer, which mlx-lm's LFM2 cannot run: refused)
    "lfm2": dict(full_attn_idxs=[1, 3]),
    # state-space heads that tile the expanded width (expand 2 x hidden 64), as the classes check
    "mamba2": dict(num_heads=8),
    "falcon_h1": dict(mamba_d_head=32, mamba_d_ssm=128),
    # attention every other layer (the default period of 8 leaves four layers without one)
    "jamba": dict(attn_layer_period=2, attn_layer_offset=1),
    "granitemoehybrid": dict(mamba_d_head=32),
    # the published layouts where the class defaults cannot run (transformers fails on them):
    # GPT-J rotates part of each head (64 of 256 dims), not more than the head
    "gptj": dict(rotary_dim=8),
    # dots.llm1 has shared experts next to the routed ones, after a dense first layer
    "dots1": dict(n_shared_experts=1, first_k_dense_replace=1),
    # LFM2-MoE interleaves short convolutions and attention, as LFM2 does
    "lfm2_moe": dict(layer_types=["conv", "full_attention", "conv", "full_attention"]),
    # LongCat-Flash: two sub-layers per layer, head_dim is the rotary part of the latent
    # attention, zero-computation experts beside the routed ones
    "longcat_flash": dict(num_layers=2, head_dim=8, zero_expert_num=2),
    # Nemotron-H's published configs set no sliding window; its Mamba width is twice the
    # model width (128 heads of 64 for a width of 4096), as here (the default is 8192 wide)
    "nemotron_h": dict(
        sliding_window=None,
        mamba_num_heads=8,
        mamba_head_dim=16,
        moe_shared_expert_intermediate_size=32,
    ),
    # MiMo-V2-Flash rotates a third of each head (64 of 192 dims published; 8 of 24 here: the
    # tiny default of 16 would rotate an odd 5)
    "mimo_v2_flash": dict(head_dim=24),
    # RecurrentGemma's attention has one key/value head, as its published configs say
    "recurrent_gemma": dict(num_key_value_heads=1),
    # DBRX keeps its attention and expert settings in nested configs
    "dbrx": dict(
        attn_config=dict(kv_n_heads=2, clip_qkv=8.0),
        ffn_config=dict(ffn_hidden_size=128, moe_num_experts=4, moe_top_k=2),
        d_model=64,  # by its own name: the class copies it into ffn_config before the alias
        rope_parameters=dict(rope_type="default", rope_theta=500000.0),
    ),
}

# Attributes set on the built config (model_type -> {dotted attribute: value}), for what the
# config classes drop from their keyword arguments but the published configs have.
ATTRIBUTES: dict[str, dict] = {
    # DBRX's attention reads attn_config.rope_theta (500000 in the published config), which
    # transformers' attention config class does not keep
    "dbrx": {"attn_config.rope_theta": 500000.0},
}

# Families that are not compared, and why.
SKIPS: dict[str, str] = {}

# Families transformers runs with a sliding window on every layer, which mlx-lm's models lack
# (refused with a window): also compared without one, as most published checkpoints are.
VARIANTS = {
    f"{family}/no-window": (family, dict(sliding_window=None))
    for family in ("mistral", "mixtral", "ministral3", "phi3", "starcoder2")
}

# Families present in both packages under another name in mlx-lm (model_type -> extra writer).
EXTRA = {
    # transformers has no MiMo: a Qwen2 checkpoint with MiMo's model_type (its MTP layers are
    # covered by the converter's MTP tests)
    "mimo": "qwen2",
}


@dataclass
class Result:
    family: str
    status: str  # exact | refused | skipped | MISMATCH
    max_diff: float | None = None
    first_diverging: int | None = None  # first position whose logits differ by more than ATOL
    reason: str = ""
    seconds: float = 0.0
    quantized: dict = dataclasses.field(default_factory=dict)  # bits -> relative error

    def row(self) -> dict:
        return dataclasses.asdict(self)


# ----------------------------------------------------------------------------------- families


def families() -> list[str]:
    """Model types with a causal-LM class in transformers and a model in mlx-lm."""
    import mlx_lm.models
    from mlx_lm.utils import MODEL_REMAPPING
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    modules = {m.name for m in pkgutil.iter_modules(mlx_lm.models.__path__)}
    both = {
        t
        for t in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
        if t in modules or MODEL_REMAPPING.get(t) in modules
    }
    return sorted(both | set(EXTRA) | set(VARIANTS))


def _shrink(config_cls, overrides: dict) -> dict:
    """SIZES (then `overrides`) restricted to what `config_cls` accepts; its text and vision
    sub-configs shrunk the same way (other sub-configs keep their defaults)."""
    fields = {f.name for f in dataclasses.fields(config_cls)}
    accepted = fields | set(getattr(config_cls, "attribute_map", {}))
    kwargs = {k: v for k, v in SIZES.items() if k in accepted}
    if "qk_rope_head_dim" in accepted:
        kwargs.pop("head_dim", None)  # latent attention: head_dim is the rope part
        kwargs["num_key_value_heads"] = kwargs.get("num_attention_heads", 4)
    if "num_experts" in accepted and "num_local_experts" in accepted:
        kwargs.pop("num_experts")  # where both exist, num_experts is usually a flag or a count
    subs = getattr(config_cls, "sub_configs", None) or {}
    for name, sub_cls in subs.items():
        if name in accepted and (name == "text_config" or "vision" in name):
            if isinstance(sub_cls, type) and dataclasses.is_dataclass(sub_cls):
                kwargs[name] = _shrink(sub_cls, overrides.get(name, {}))
        elif name in overrides:  # other sub-configs: the override as given
            kwargs[name] = overrides[name]
    kwargs.update({k: v for k, v in overrides.items() if k not in subs})
    if "vocab_size" in accepted:
        kwargs["vocab_size"] = hfm.VOCAB
    return kwargs


def tiny_config(family: str, **edits):
    """transformers config of `family` (or of a VARIANTS entry): class defaults, tiny sizes,
    then `edits`."""
    from transformers import CONFIG_MAPPING

    family, extra = VARIANTS.get(family, (family, {}))
    config_cls = CONFIG_MAPPING[EXTRA.get(family, family)]
    config = config_cls(**_shrink(config_cls, {**OVERRIDES.get(family, {}), **extra, **edits}))
    for dotted, value in ATTRIBUTES.get(family, {}).items():
        *path, name = dotted.split(".")
        target = config
        for part in path:
            target = getattr(target, part)
        setattr(target, name, value)
    return config


# ------------------------------------------------------------------------------------ running


def token_ids(n: int = SEQ_LEN, seed: int = 0) -> list[int]:
    """BOS then `n - 1` ordinary ids of the tiny vocabulary."""
    rng = np.random.default_rng(seed)
    return [tm.BOS_ID] + [int(i) for i in rng.integers(3, hfm.VOCAB, n - 1)]


@contextmanager
def _quiet():
    from transformers.utils import logging as hf_logging

    level = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield
    finally:
        hf_logging.set_verbosity(level)


def write_checkpoint(family: str, path: Path, seed: int = 0, **edits):
    """(path, torch model): the tiny random `family` checkpoint (its config with `edits`) saved
    sharded at `path`."""
    from transformers import AutoModelForCausalLM

    config = tiny_config(family, **edits)
    torch.manual_seed(seed)
    with _quiet():
        model = AutoModelForCausalLM.from_config(config, attn_implementation="eager")
    hfm.randomize(model.float(), seed)
    with _quiet():
        hfm.save(model, path, max_shard_size=SHARD)
    if family in EXTRA:
        hfm.edit_config(path, model_type=family)
    return path, model


def mlx_logits(model, ids: list[int], chunks=None) -> np.ndarray:
    """[len(ids), V] float32 logits through a fresh cache: one pass, or `chunks` passes."""
    from mlx_lm.models.cache import make_prompt_cache

    cache = make_prompt_cache(model)
    chunks = chunks or (len(ids),)
    out, start = [], 0
    while start < len(ids):
        size = chunks[min(len(out), len(chunks) - 1)]
        piece = ids[start : start + size]
        logits = model(mx.array([piece]), cache=cache)
        out.append(np.array(logits[0].astype(mx.float32)))
        start += len(piece)
    return np.concatenate(out)


def compare(got: np.ndarray, want: np.ndarray) -> tuple[float, int | None]:
    """(max |got - want|, first position where it exceeds ATOL or None)."""
    if got.shape != want.shape:
        raise ValueError(f"logits shape {got.shape}, transformers' {want.shape}")
    diff = np.abs(got - want).max(axis=-1)
    bad = np.nonzero(~(diff <= ATOL))[0]  # NaN counts as a difference
    return float(np.nan_to_num(diff.max(), nan=np.inf)), int(bad[0]) if len(bad) else None


def _one_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}"[:300]


def run_family(family: str, root: Path, quant_bits=(), ids=None, perturb=None) -> Result:
    """Write, convert, load and compare one family (see the module docstring).

    `perturb(path)` edits the converted directory before loading (the negative control)."""
    start = time.perf_counter()
    ids = ids or token_ids()
    result = Result(family, "skipped")
    if family in SKIPS:
        result.reason = SKIPS[family]
        return result
    source = root / f"{family.replace('/', '-')}-hf"
    try:
        _, torch_model = write_checkpoint(family, source)
        with _quiet(), torch.no_grad():
            want = hfm.hf_logits(torch_model, ids)
    except Exception as exc:  # transformers cannot build or run it: nothing to compare with
        result.reason = f"transformers: {_one_line(exc)}"
        result.seconds = time.perf_counter() - start
        return result
    del torch_model
    float_logits = None
    for bits in (None, *quant_bits):
        dest = root / f"{family.replace('/', '-')}-mlx{bits or ''}"
        quant = Quantization(bits=bits, group_size=32) if bits else None
        try:
            with _quiet():
                convert_checkpoint(str(source), str(dest), dtype="float32", quantization=quant)
            if perturb is not None:
                perturb(dest)
            with _quiet():
                model, _ = mlx_spec.load(str(dest))
        except Exception as exc:
            # ConversionError: refused with its reason; anything else is a crash (no logits
            # either, but not the one-line refusal a family must get)
            status = "refused" if isinstance(exc, ConversionError) else "error"
            if bits is None:
                result.status, result.reason = status, _one_line(exc)
                break
            result.quantized[bits] = f"{status}: {_one_line(exc)}"
            continue
        if bits is None:
            full = mlx_logits(model, ids)
            chunked = mlx_logits(model, ids, CHUNKS)
            d1, p1 = compare(full, want)
            d2, p2 = compare(chunked, want)
            result.max_diff = max(d1, d2)
            positions = [p for p in (p1, p2) if p is not None]
            result.first_diverging = min(positions) if positions else None
            result.status = "exact" if result.first_diverging is None else "MISMATCH"
            float_logits = full
        else:
            got = mlx_logits(model, ids)
            err = np.linalg.norm(got - float_logits) / np.linalg.norm(float_logits)
            result.quantized[bits] = float(err)
        del model
    result.seconds = time.perf_counter() - start
    return result


def run_matrix(selected=None, quant=True, progress=None, keep=None) -> list[Result]:
    """Results for `selected` families (default: all); `progress(i, n, result)` after each."""
    names = list(selected or families())
    results = []
    root = Path(keep) if keep else Path(tempfile.mkdtemp(prefix="conformance-"))
    try:
        for i, family in enumerate(names):
            bits = tuple(QUANT_BOUNDS) if quant and family in QUANT_FAMILIES else ()
            try:
                result = run_family(family, root, quant_bits=bits)
            except Exception as exc:  # a crash in the comparison itself: reported, never hidden
                result = Result(family, "MISMATCH", reason=f"crashed: {_one_line(exc)}")
                if os.environ.get("MLX_SPEC_CONFORMANCE_TRACE"):
                    traceback.print_exc()
            results.append(result)
            if progress:
                progress(i + 1, len(names), result)
            for stale in root.glob(f"{family.replace('/', '-')}-*"):
                shutil.rmtree(stale, ignore_errors=True)
    finally:
        if keep is None:
            shutil.rmtree(root, ignore_errors=True)
    return results


def quant_ok(result: Result) -> bool:
    """Every quantized conversion of `result` within its bound (or refused with a reason)."""
    return all(
        isinstance(err, str) or err <= QUANT_BOUNDS[bits] for bits, err in result.quantized.items()
    )


def format_row(r: Result) -> str:
    diff = "-" if r.max_diff is None else f"{r.max_diff:.1e}"
    pos = "-" if r.first_diverging is None else str(r.first_diverging)
    quant = " ".join(
        f"q{b}={e:.3f}" if not isinstance(e, str) else f"q{b}=refused"
        for b, e in r.quantized.items()
    )
    note = r.reason if r.status != "exact" else quant
    return f"{r.family:<20} {r.status:<9} {diff:>8} {pos:>4}  {note}"


def summary(results: list[Result]) -> dict:
    counts: dict[str, int] = {}
    for r in results:
        counts[r.status] = counts.get(r.status, 0) + 1
    return counts


def to_json(results: list[Result], path: Path, seconds: float) -> None:
    payload = {
        "atol": ATOL,
        "sequence": SEQ_LEN,
        "sliding_window": WINDOW,
        "quant_bounds": QUANT_BOUNDS,
        "seconds": round(seconds, 1),
        "summary": summary(results),
        "families": [r.row() for r in results],
    }
    Path(path).write_text(json.dumps(payload, indent=2, default=str))
