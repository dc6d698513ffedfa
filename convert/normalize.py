"""config.json as transformers writes it -> the keys mlx-lm's `ModelArgs` reads.

transformers renames and restructures config keys between versions (`rope_parameters` instead of
`rope_theta`, `layer_types` instead of a sliding-window pattern, `num_local_experts` instead of
`num_experts`, `n_positions` instead of `n_ctx`, ...), while each mlx-lm model reads the keys of
the checkpoints it was written against. A key mlx-lm requires but cannot find refuses the model; a
key it has a default for is worse: the default is used silently. So every field of the family's
`ModelArgs` that the config lacks is looked up, in order:

1. in the config itself under a synonym (`SYNONYMS`: names transformers no longer has at all);
2. on transformers' own config class for the family, instantiated from the config: its
   `attribute_map` resolves aliases and its defaults are the values transformers computes with.

Sliding-window layouts are translated from `layer_types` into the form the mlx-lm model takes (a
period, a per-layer string, or the list itself), and refused when that form cannot express them or
when the mlx-lm model has no sliding window at all. transformers is optional here: an unknown
config class, or one that rejects the config, leaves step 2 out.
"""

from __future__ import annotations

import dataclasses
import inspect
import typing

from convert.errors import ConversionError

# mlx-lm field -> keys that hold the same value in configs written by newer transformers.
SYNONYMS: dict[str, tuple[str, ...]] = {
    "n_ctx": ("n_positions", "max_position_embeddings"),
    "n_positions": ("max_position_embeddings", "n_ctx"),
    "rotary_emb_base": ("rope_theta",),
    "rotary_pct": ("partial_rotary_factor",),
    "num_experts": ("num_local_experts", "n_routed_experts"),
    "num_local_experts": ("num_experts", "n_routed_experts"),
    "n_routed_experts": ("num_local_experts", "num_experts"),
    "layer_norm_eps": ("layer_norm_epsilon", "norm_eps"),
    "layer_norm_epsilon": ("layer_norm_eps", "norm_eps"),
}


def _head_dim(cfg: dict):
    hidden, heads = cfg.get("hidden_size"), cfg.get("num_attention_heads")
    return hidden // heads if isinstance(hidden, int) and isinstance(heads, int) and heads else None


# mlx-lm field -> how transformers' models compute it when the config does not set it.
DERIVED = {"head_dim": _head_dim}


def _rotary_dim(cfg: dict):
    params = cfg.get("rope_parameters") or {}
    head_dim = cfg.get("head_dim") or _head_dim(cfg)
    factor = params.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 1.0))
    return int(head_dim * factor) if head_dim else None


def _moe_layers(cfg: dict):
    """Per layer: a mixture of experts (transformers' `mlp_layer_types`, else the dense layers
    `first_k_dense_replace` puts first)."""
    kinds = cfg.get("mlp_layer_types")
    if isinstance(kinds, list):
        return [k == "sparse" for k in kinds]
    first = cfg.get("first_k_dense_replace") or 0
    return [i >= first for i in range(cfg["num_hidden_layers"])]


# An IMPLIED value meaning "the key set to null" (a required field whose value is None).
NULL = object()

# Family -> mlx-lm fields that transformers' model of that family does not read from its config
# but hard-codes or computes: the values it computes with, filled where the config lacks them
# (configs written by transformers' own classes leave these keys out).
IMPLIED = {
    # pre-norm blocks, query/key norms, no MLP bias
    "apertus": lambda c: dict(mlp_bias=False, post_norm=False, qk_norm=True),
    "exaone_moe": lambda c: dict(is_moe_layer=_moe_layers(c)),
    # the block width is the model width; the MLP width is intermediate_size (adjusted alike)
    "lfm2": lambda c: dict(block_dim=c.get("hidden_size"), block_ff_dim=c.get("intermediate_size")),
    "minimax_m2": lambda c: dict(shared_intermediate_size=0, rotary_dim=_rotary_dim(c)),
    # DeepSeek-V3 routing (sigmoid scores, group-limited top-k with the correction bias), a
    # mixture of experts on every layer after the first dense ones
    "mamba2": lambda c: dict(intermediate_size=int(c.get("expand", 2) * c["hidden_size"])),
    # an unset inner width is 4x the model width
    "gpt_bigcode": lambda c: dict(n_inner=4 * c["n_embd"] if c.get("n_embd") else None),
    # every layer a mixture of experts (no dense MLP, so no dense width), rotary on the whole head
    "solar_open": lambda c: dict(
        first_k_dense_replace=0,
        intermediate_size=c.get("moe_intermediate_size"),
        partial_rotary_factor=1.0,
    ),
    "glm_moe_dsa": lambda c: dict(topk_method="noaux_tc", scoring_func="sigmoid", moe_layer_freq=1),
    # MiMo-V2-Flash: DeepSeek-V3 routing without shared experts; the sliding layers have twice
    # the key/value heads and attention sinks, the full ones neither; one head size for both
    "mimo_v2_flash": lambda c: dict(
        topk_method="noaux_tc",
        scoring_func="sigmoid",
        n_shared_experts=NULL,
        moe_layer_freq=[int(m) for m in _moe_layers(c)],
        layernorm_epsilon=c.get("rms_norm_eps"),
        swa_rope_theta=c.get("rope_local_base_freq"),
        swa_num_attention_heads=c.get("num_attention_heads"),
        swa_num_key_value_heads=2 * c["num_key_value_heads"],
        swa_head_dim=c.get("head_dim"),
        swa_v_head_dim=c.get("v_head_dim"),
        add_swa_attention_sink_bias=True,
        add_full_attention_sink_bias=False,
    ),
    # expert weights from the softmax over all experts (a load-time fix)
    "jamba": lambda c: dict(router_softmax_all=True),
    # experts chosen with the score-correction bias (a load-time fix keeps it)
    "ernie4_5_moe": lambda c: dict(moe_score_correction=True),
    # latent attention with both low-rank parts scaled by sqrt(hidden / rank); the
    # zero-computation experts return their input
    "longcat_flash": lambda c: dict(
        attention_method="MLA",
        zero_expert_type="identity",
        mla_scale_q_lora=True,
        mla_scale_kv_lora=True,
    ),
}

# Keys a multimodal wrapper's ModelArgs reads at the top level that transformers keeps only in the
# nested text_config.
_FROM_TEXT = {"vocab_size", "hidden_size", "num_hidden_layers", "tie_word_embeddings"}

# Read-only properties of transformers' classes that mlx-lm also computes itself: written into
# config.json they make transformers' own loader (the tokenizer's) fail.
_RELOAD_BREAKS = {"layers_block_type"}

# Keys never taken from transformers' class: they describe the checkpoint, not the architecture,
# or mlx-lm derives them itself.
_NOT_FILLED = {"model_type", "quantization", "quantization_config", "text_config"}

# Families whose mlx-lm model computes logits transformers' does not give, with no load-time fix
# yet: refused rather than converted into a model that diverges silently.
DIVERGENT = {
    "minimax": (
        "mlx-lm's minimax model is MiniMax-M2's; this MiniMax (Text-01) has lightning-attention "
        "layers and no query/key norms"
    ),
}

# Families whose mlx-lm model names layer kinds as their checkpoints did before transformers
# renamed them: transformers' name -> mlx-lm's.
LAYER_TYPE_NAMES = {
    "granitemoehybrid": {"linear_attention": "mamba", "full_attention": "attention"},
}

SLIDING = "sliding_attention"
FULL = "full_attention"

# Families whose mlx-lm model builds its attention masks from its first sliding-window layer
# and its first full-attention layer: a config that lacks either kind cannot run there.
NEEDS_BOTH_KINDS = ("exaone4", "olmo3")


def normalize_config(config: dict) -> dict:
    """A copy of `config` with the keys mlx-lm reads filled from the forms transformers writes."""
    config = dict(config)
    family = config.get("model_type")
    if family in DIVERGENT:
        raise ConversionError(f"{family}: not converted: {DIVERGENT[family]}")
    if family == "llama4_text" and config.get("moe_layers"):
        raise ConversionError(
            "llama4_text: not converted: mlx-lm's llama4_text is the dense variant; this config "
            f"has mixture-of-experts layers {config['moe_layers']}"
        )
    if family == "recurrent_gemma" and config.get("num_key_value_heads", 1) != 1:
        raise ConversionError(
            "recurrent_gemma: mlx-lm's RecurrentGemma has one key/value head; this config has "
            f"{config['num_key_value_heads']}"
        )
    if family == "lfm2" and "conv" not in (config.get("layer_types") or ["conv"]):
        raise ConversionError("lfm2: no short-convolution layer: mlx-lm's LFM2 needs at least one")
    if family in LAYER_TYPE_NAMES and isinstance(config.get("layer_types"), list):
        names = LAYER_TYPE_NAMES[family]
        config["layer_types"] = [names.get(t, t) for t in config["layer_types"]]
    if config.get("model_type") in ("qwen3_5_text", "qwen3_5_moe_text"):
        # mlx-lm's qwen3_5 and qwen3_5_moe take a flat text config too
        config["model_type"] = config["model_type"].removesuffix("_text")
    for part in (config, config.get("text_config")):
        if isinstance(part, dict):
            _normalize_rope(part)
    text = config.get("text_config")
    if isinstance(text, dict):
        config["text_config"] = text = dict(text)
    for part in (config, text):
        if not isinstance(part, dict):
            continue
        args_cls = _args_class(part)
        if args_cls is not None:
            _fill_fields(part, args_cls)
        _normalize_sliding_pattern(part, args_cls)
        _check_both_kinds(part)
    return config


def _check_both_kinds(cfg: dict) -> None:
    """Refuse an EXAONE 4 or OLMo 3 config whose layers are all sliding-window (or all full)
    attention: the published models interleave them, and mlx-lm's models need one of each."""
    family = cfg.get("model_type")
    if family not in NEEDS_BOTH_KINDS:
        return
    if family == "exaone4":
        pattern = cfg.get("sliding_window_pattern")
        if not isinstance(pattern, str) or not pattern:
            return  # no window: every layer attends to the whole context
        kinds = {SLIDING if c == "L" else FULL for c in pattern}
    else:
        layers = cfg.get("num_hidden_layers") or 0
        types = cfg.get("layer_types") or [
            FULL if (i + 1) % 4 == 0 else SLIDING
            for i in range(layers)  # mlx-lm's default
        ]
        kinds = set(types)
    for kind, word in ((FULL, "sliding-window"), (SLIDING, "full")):
        if kinds and kind not in kinds:
            raise ConversionError(
                f"{family}: every layer is {word} attention; mlx-lm's {family} model needs "
                "both sliding-window and full-attention layers, as the published models have "
                "(a full-attention layer every few): not converted"
            )


# ------------------------------------------------------------------------------------- rope


def _normalize_rope(cfg: dict) -> None:
    params = cfg.get("rope_parameters")
    if not isinstance(params, dict):
        return
    if "full_attention" in params:  # gemma3: one entry per attention type
        sliding = params.get("sliding_attention") or {}
        if "rope_theta" in sliding:
            cfg.setdefault("rope_local_base_freq", sliding["rope_theta"])
        params = params["full_attention"] or {}
    for key in ("rope_theta", "partial_rotary_factor"):
        if params.get(key) is not None:
            cfg.setdefault(key, params[key])
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type != "default" and not cfg.get("rope_scaling"):
        cfg["rope_scaling"] = {**params, "type": rope_type}
    cfg.setdefault("rope_scaling", None)  # some mlx-lm models require the key
    if cfg.get("rope_scaling") is None and cfg.get("model_type") in UNSCALED_ROPE:
        cfg["rope_scaling"] = UNSCALED_ROPE[cfg["model_type"]](cfg)


# Families whose mlx-lm model always applies its checkpoints' rope scaling (YaRN, LongRoPE) and
# cannot run without one: the scaling that changes nothing (factor 1), for configs that set none.
UNSCALED_ROPE = {
    "deepseek_v2": lambda c: {
        "type": "yarn",
        "factor": 1.0,
        "mscale": 1.0,
        "mscale_all_dim": 0,
        "original_max_position_embeddings": c.get("max_position_embeddings"),
    },
    "minicpm3": lambda c: {
        "type": "longrope",
        "short_factor": [1.0] * (c.get("qk_rope_head_dim", 2) // 2),
        "long_factor": [1.0] * (c.get("qk_rope_head_dim", 2) // 2),
        "original_max_position_embeddings": c.get("max_position_embeddings"),
    },
}


# ----------------------------------------------------------------------------- ModelArgs fields


def _args_class(config: dict):
    """mlx-lm's ModelArgs dataclass for `config`, or None (unknown families are refused later)."""
    if "model_type" not in config:
        return None
    from mlx_spec.models import reference_fixes

    from mlx_lm.utils import _get_classes

    reference_fixes.install()  # the fields its fixes read belong to ModelArgs
    try:
        _, args_cls = _get_classes(config)
    except (ValueError, ImportError, SystemExit):  # some mlx-lm modules exit without a package
        return None
    return args_cls if dataclasses.is_dataclass(args_cls) else None


def _hf_config(config: dict):
    """transformers' config object for `config`, or None when transformers cannot build one."""
    try:
        from transformers import CONFIG_MAPPING
        from transformers.utils import logging as hf_logging
    except ImportError:  # pragma: no cover - transformers comes with mlx-lm
        return None
    model_type = config.get("model_type")
    if model_type not in CONFIG_MAPPING:
        return None
    kwargs = {k: v for k, v in config.items() if k not in ("model_type", "transformers_version")}
    level = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    try:
        return CONFIG_MAPPING[model_type](**kwargs)
    except Exception:  # a config the class rejects: fall back to the synonyms alone
        return None
    finally:
        hf_logging.set_verbosity(level)


def _plain(value) -> bool:
    """A JSON value (what config.json could have held)."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return True
    if isinstance(value, (list, tuple)):
        return all(_plain(v) for v in value)
    if isinstance(value, dict):
        return all(isinstance(k, str) and _plain(v) for k, v in value.items())
    return False


def _fits(value, field: dataclasses.Field) -> bool:
    """`value` can stand where `field`'s default stands (same kind of value)."""
    default = field.default
    if default is dataclasses.MISSING or default is None:
        return True
    if isinstance(default, bool) or isinstance(value, bool):
        return isinstance(default, bool) and isinstance(value, bool)
    if isinstance(default, (int, float)):
        return isinstance(value, (int, float))
    return isinstance(value, type(default))


def _fill_fields(config: dict, args_cls) -> None:
    """Fill each ModelArgs field `config` lacks from a synonym, else from transformers' class."""
    fields = [f for f in dataclasses.fields(args_cls) if f.name not in _NOT_FILLED]
    missing = [f for f in fields if f.name not in config]
    if not missing:
        return
    hf = None
    text = config.get("text_config") if isinstance(config.get("text_config"), dict) else {}
    for field in missing:
        for alias in SYNONYMS.get(field.name, ()):
            if config.get(alias) is not None:
                config[field.name] = config[alias]
                break
        else:
            if text.get(field.name) is not None and field.name in _FROM_TEXT:
                config[field.name] = text[field.name]  # a wrapper reading the text model's value
                continue
            if hf is None:
                hf = _hf_config(config) or False
            if not hf:
                continue
            attr = getattr(type(hf), field.name, None)
            if isinstance(attr, property) and attr.fset is None and field.name in _RELOAD_BREAKS:
                continue  # computed by transformers from other keys; as a key it breaks reloading
            try:
                value = getattr(hf, field.name)
            except Exception:  # attributes computed from others can raise
                continue
            if value is None:
                for alias in SYNONYMS.get(field.name, ()):
                    value = getattr(hf, alias, None)
                    if value is not None:
                        break
            if value is not None and _plain(value) and _fits(value, field):
                config[field.name] = list(value) if isinstance(value, tuple) else value
    implied = IMPLIED.get(config.get("model_type"))
    if implied is not None:
        names = {f.name for f in fields}
        for name, value in implied(config).items():
            if value is NULL:
                if name in names:
                    config.setdefault(name, None)
            elif name in names and config.get(name) is None and value is not None:
                config[name] = value
    for name, derive in DERIVED.items():
        if name not in config and any(f.name == name for f in fields):
            value = derive(config)
            if value is not None:
                config[name] = value


# ------------------------------------------------------------------------------- sliding window


def _field_type(args_cls, name: str):
    if args_cls is None:
        return None
    for field in dataclasses.fields(args_cls):
        if field.name == name:
            try:
                hints = typing.get_type_hints(args_cls)
            except Exception:
                return field.type
            return hints.get(name, field.type)
    return None


def _takes(args_cls, name: str) -> bool:
    return args_cls is not None and any(f.name == name for f in dataclasses.fields(args_cls))


def _normalize_sliding_pattern(cfg: dict, args_cls=None) -> None:
    """Translate `layer_types` into the sliding-window form mlx-lm's model reads."""
    types = cfg.get("layer_types")
    if not isinstance(types, list) or not types:
        _refuse_uniform_window(cfg, args_cls)
        return
    sliding = [t == SLIDING for t in types]
    window = cfg.get("sliding_window")
    family = cfg.get("model_type")
    if args_cls is None:  # a nested text config: mlx-lm's gemma wrappers read the period
        if "sliding_window_pattern" not in cfg and "gemma" in str(family) and any(sliding):
            period = _period(cfg, sliding)
            if period is None:
                raise ConversionError(f"{family}: {_not_periodic(types)}")
            cfg["sliding_window_pattern"] = period
        return
    if _takes(args_cls, "hybrid_layer_pattern"):
        _hybrid_pattern(cfg, sliding, window)
        return
    if not any(sliding) or window is None:
        return
    if _takes(args_cls, "layer_types"):
        return  # the mlx-lm model reads the list itself
    if _takes(args_cls, "sliding_window_pattern"):
        kind = _field_type(args_cls, "sliding_window_pattern")
        if "str" in str(kind):  # one letter per layer: L(ocal) or G(lobal)
            cfg["sliding_window_pattern"] = "".join("L" if s else "G" for s in sliding)
            return
        period = _period(cfg, sliding)
        if period is None:
            raise ConversionError(f"{family}: {_not_periodic(types)}")
        cfg["sliding_window_pattern"] = period
        return
    if not _takes(args_cls, "sliding_window"):
        raise ConversionError(
            f"{family}: {sum(sliding)} layer(s) use a sliding window of {window} tokens but "
            "mlx-lm's model has no sliding window; its logits would differ past that length"
        )


def _hybrid_pattern(cfg: dict, sliding: list[bool], window) -> None:
    """MiMo-V2-Flash's form: `hybrid_layer_pattern` (1 marks a sliding layer) and the window
    `sliding_window_size`, which mlx-lm's model reads as the number of keys attended to, as
    transformers' `sliding_window`. The model finds one layer of each kind and rotates the same
    part of every head."""
    family = cfg.get("model_type")
    if window is None and isinstance(cfg.get("sliding_window_size"), int):
        # the released configs' name: transformers attends to that many tokens plus the query
        window = cfg["sliding_window"] = cfg["sliding_window_size"] + 1
    if all(sliding) or not any(sliding) or not isinstance(window, int):
        raise ConversionError(
            f"{family}: mlx-lm's model needs both sliding-window and full-attention layers "
            f"(and a window); this config has {sum(sliding)} sliding of {len(sliding)}"
        )
    params = cfg.get("rope_parameters")
    if isinstance(params, dict) and "sliding_attention" in params:
        factors = {
            (params.get(kind) or {}).get("partial_rotary_factor") for kind in (SLIDING, FULL)
        }
        if len(factors) > 1:
            raise ConversionError(
                f"{family}: the sliding and full layers rotate different parts of each head "
                f"({sorted(factors, key=str)}); mlx-lm's model rotates one"
            )
    rotary = _rotary_dim(cfg)
    if rotary is not None and rotary % 2:
        raise ConversionError(f"{family}: {rotary} rotary dimensions per head: mlx-lm needs even")
    cfg["hybrid_layer_pattern"] = [int(s) for s in sliding]
    cfg["sliding_window_size"] = window


def _refuse_uniform_window(cfg: dict, args_cls) -> None:
    """A `sliding_window` without `layer_types`: transformers applies it to every layer (Mistral,
    Mixtral, Phi-3, StarCoder2). Where a load-time fix runs such a window (`UNIFORM_WINDOW`) the
    config is marked with `layer_types` all sliding; elsewhere it is refused."""
    from mlx_spec.models.reference_fixes import UNIFORM_WINDOW

    window = cfg.get("sliding_window")
    if args_cls is None or not isinstance(window, int) or isinstance(window, bool):
        return
    context = cfg.get("max_position_embeddings")
    if isinstance(context, int) and window >= context:
        return  # the window never cuts anything off
    if cfg.get("use_sliding_window") is False or not _reference_reads_window(cfg):
        return
    layers = cfg.get("num_hidden_layers")
    if cfg.get("model_type") in UNIFORM_WINDOW and isinstance(layers, int):
        cfg["layer_types"] = [SLIDING] * layers
        return
    raise ConversionError(
        f"{cfg.get('model_type')}: sliding_window {window} applies to every layer but mlx-lm's "
        f"model attends to the whole context; its logits would differ past {window} tokens"
    )


def _reference_reads_window(cfg: dict) -> bool:
    """Whether transformers' model of the family has a sliding window at all: its config class
    declares `sliding_window` and its modeling code reads it (Llama's class does not declare it;
    Nemotron-H's declares it but its model never reads it: a window changes nothing in either).
    Unknown families: assume so."""
    try:
        from transformers import CONFIG_MAPPING
    except ImportError:  # pragma: no cover - transformers comes with mlx-lm
        return True
    if cfg.get("model_type") not in CONFIG_MAPPING:
        return True
    config_cls = CONFIG_MAPPING[cfg["model_type"]]
    declared = {}
    for klass in reversed(config_cls.__mro__):
        declared.update(getattr(klass, "__annotations__", {}))
    if (
        "sliding_window" not in declared
        and "sliding_window" not in inspect.signature(config_cls.__init__).parameters
    ):
        return False
    source = _modeling_source(config_cls)
    return source is None or "sliding_window" in source


def _modeling_source(config_cls) -> str | None:
    """The text of transformers' modeling module beside `config_cls`'s, or None when not found
    (read, not imported: importing a modeling module is slow)."""
    import importlib.util

    package, _, name = config_cls.__module__.rpartition(".")
    if not name.startswith("configuration_"):
        return None
    try:
        spec = importlib.util.find_spec(f"{package}.modeling_{name.removeprefix('configuration_')}")
        if spec is None or not spec.origin:
            return None
        with open(spec.origin, encoding="utf-8") as handle:
            return handle.read()
    except (ImportError, OSError, ValueError):
        return None


def _period(cfg: dict, sliding: list[bool]) -> int | None:
    """P such that layer i is full-attention iff i % P == P - 1, if the layout is that."""
    if cfg.get("sliding_window_pattern") and isinstance(cfg["sliding_window_pattern"], int):
        period = cfg["sliding_window_pattern"]
    elif cfg.get("_sliding_window_pattern"):
        period = cfg["_sliding_window_pattern"]
    elif False in sliding:
        period = sliding.index(False) + 1
    else:
        period = len(sliding) + 1  # no full-attention layer within the model
    expected = [i % period != period - 1 for i in range(len(sliding))]
    return period if expected == sliding else None


def _not_periodic(types: list) -> str:
    letters = "".join("S" if t == SLIDING else "F" for t in types)
    letters = letters if len(letters) <= 24 else letters[:24] + "..."
    return (
        f"layer_types {letters} is not a repeating run of sliding-window layers closed by one "
        "full-attention layer, the only layout mlx-lm's model has"
    )
