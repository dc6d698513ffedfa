"""Train the embedded demo pair from nothing, on the Python standard library's sources.

Stages (each resumable; run them in order, or `all`):
  tokenizer  byte-level BPE (4096 tokens) on the training files
  target     a Qwen2-layout target trained with PyTorch (the fastest trainer on CPU here)
  convert    the target converted to MLX with `mlx-spec convert` (for distillation)
  draft      a small draft model distilled with `mlx-spec distill`
  mtp        an MTP head distilled with `mlx-spec distill --kind mtp --mtp-family mimo`
  refine     (instead of draft and mtp) train the shipped pair's drafters further: each starts
             from the shipped weights (`mlx-spec distill --init`) and trains on the training
             files plus the target's own continuations of windows of them (`--target-tokens`)
  export     both written in Hugging Face layout: the target as MiMo (its MTP layer under
             `model.mtp_layers.0.*`, so the real MTP conversion path serves it) and the draft
  medusa     Medusa heads distilled for the shipped target (`mlx-spec distill --kind medusa`)
             and bundled into it as `model-medusa.safetensors` (`medusa_head.*`, the Medusa-2
             layout), so its conversion writes them to `medusa/`
  eagle3     an EAGLE-3 head distilled for the shipped target (`mlx-spec distill --kind
             eagle3`), shipped in `demo_pair/eagle3/` (float16, the EAGLE repository's layout),
             which the pair's conversion writes to the converted target's `eagle3/`
  dflash     a DFlash block drafter distilled likewise (`--kind dflash`), shipped in
             `demo_pair/dflash/` in z-lab's layout (a Qwen3 config with `dflash_config`)

A fixed list of files is held out for evaluation and never trained on. Requires torch
(`pip install torch==2.13.0`) and transformers for the target stage only.

    python scripts/train_embedded_pair.py all --total-steps 880 --distill-steps 400

(the first recipe: 880 target steps of 16 x 256 tokens, about 1.1 epochs, then 400
distillation steps for each drafter), or `--minutes N` instead of `--total-steps` to fit a time
budget. The shipped drafters were then refined, the MTP head for 2000 steps and the draft model
for 1000, on the training files plus a million tokens of the target's own text:

    python scripts/train_embedded_pair.py refine --distill-steps 2000 --target-tokens 1000000
    rm -r $MLX_SPEC_TRAIN_DIR/draft-mlx   # (the MTP head, finished, is skipped)
    python scripts/train_embedded_pair.py refine --distill-steps 1000 --target-tokens 1000000
    python scripts/train_embedded_pair.py export
    python scripts/train_embedded_pair.py medusa --distill-steps 400

and the EAGLE-3 head and the DFlash drafter were distilled on a GPU (MLX's CUDA backend, an
NVIDIA H100: about 30 steps/s each, 13 minutes each), both on the training files plus a
million tokens of the target's own text, the two running side by side:

    python scripts/train_embedded_pair.py eagle3 --distill-steps 23500 --distill-batch 16 \
        --target-tokens 1000000 --target-batch 256
    python scripts/train_embedded_pair.py dflash --distill-steps 27200 --distill-batch 16 \
        --target-tokens 1000000 --target-batch 256

`mlx_spec/demo_pair/training.json` holds the logs of every round.

Work files (checkpoints, converted models) go to $MLX_SPEC_TRAIN_DIR, else build/embedded;
the target stage resumes from its checkpoint there (`--total-steps` extends a finished run).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

from mlx_spec.embedded import stdlib_files

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
WORK = Path(os.environ.get("MLX_SPEC_TRAIN_DIR") or ROOT / "build" / "embedded")
OUT = ROOT / "mlx_spec" / "demo_pair"
VOCAB = 4096
EOS = "<|endoftext|>"
TARGET = dict(
    hidden_size=384,
    intermediate_size=1024,
    num_hidden_layers=8,
    num_attention_heads=6,
    num_key_value_heads=2,
    max_position_embeddings=1024,
)


def stage_tokenizer(args) -> None:
    from tokenizers import ByteLevelBPETokenizer

    train, _ = stdlib_files()
    tok = ByteLevelBPETokenizer()
    tok.train([str(p) for p in train], vocab_size=VOCAB, min_frequency=2, special_tokens=[EOS])
    (WORK / "tokenizer").mkdir(parents=True, exist_ok=True)
    tok.save(str(WORK / "tokenizer" / "tokenizer.json"))
    print(f"tokenizer: {tok.get_vocab_size()} tokens from {len(train)} files")


def load_tokenizer():
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(WORK / "tokenizer" / "tokenizer.json"))


def encode(files: list[Path]) -> np.ndarray:
    tok = load_tokenizer()
    eos = tok.token_to_id(EOS)
    ids: list[int] = []
    for path in files:
        ids += tok.encode(path.read_text(errors="replace")).ids + [eos]
    return np.asarray(ids, np.int32)


def _target_config():
    from transformers import Qwen2Config

    tok = load_tokenizer()
    eos = tok.token_to_id(EOS)
    return Qwen2Config(
        vocab_size=VOCAB,
        tie_word_embeddings=True,
        rope_theta=10000.0,
        bos_token_id=eos,
        eos_token_id=eos,
        **TARGET,
    )


def stage_target(args) -> None:
    import torch
    from transformers import Qwen2ForCausalLM

    torch.manual_seed(0)
    torch.set_num_threads(args.threads)
    train_files, held_files = stdlib_files()
    data, held = encode(train_files), encode(held_files)
    model = Qwen2ForCausalLM(_target_config())
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.1, betas=(0.9, 0.95))
    ckpt = WORK / "target-train.pt"
    state = {"step": 0, "total": None, "log": []}
    if ckpt.exists():
        saved = torch.load(ckpt, weights_only=False)
        model.load_state_dict(saved["model"])
        opt.load_state_dict(saved["opt"])
        state = saved["state"]
    if args.total_steps:
        state["total"] = args.total_steps
    print(
        f"target: {sum(p.numel() for p in model.parameters()) / 1e6:.1f}M params, "
        f"{data.size} training tokens, {held.size} held out; resuming at {state['step']}"
    )
    _train_loop(model, opt, data, held, state, ckpt, args)
    out = WORK / "target-hf"
    model.save_pretrained(out, safe_serialization=True)
    shutil.copy(WORK / "tokenizer" / "tokenizer.json", out / "tokenizer.json")
    (out / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "tokenizer_class": "PreTrainedTokenizerFast",
                "eos_token": EOS,
                "bos_token": EOS,
                "unk_token": None,
                "model_max_length": TARGET["max_position_embeddings"],
            }
        )
    )


def _batch(data: np.ndarray, rng, batch: int, seq: int):
    import torch

    starts = rng.integers(0, data.size - seq - 1, size=batch)
    return torch.from_numpy(np.stack([data[s : s + seq + 1] for s in starts]).astype(np.int64))


def _lr(step: int, total: int, peak: float) -> float:
    warm = max(1, total // 50)
    if step < warm:
        return peak * (step + 1) / warm
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * (step - warm) / (total - warm))))


def _train_loop(model, opt, data, held, state, ckpt, args) -> None:
    import torch

    rng = np.random.default_rng(state["step"])
    tic, last_save = time.time(), time.time()
    while state["total"] is None or state["step"] < state["total"]:
        if state["total"] is None and state["step"] == 10:
            per_step = (time.time() - tic) / 10
            state["total"] = max(20, int(args.minutes * 60 / per_step))
            print(f"{per_step:.2f} s/step: planning {state['total']} steps")
        for group in opt.param_groups:
            group["lr"] = _lr(state["step"], state["total"] or 10**9, args.lr)
        batch = _batch(data, rng, args.batch, args.seq)
        loss = model(input_ids=batch[:, :-1], labels=batch[:, :-1].clone()).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        state["step"] += 1
        if state["step"] % 50 == 0:
            entry = {"step": state["step"], "loss": loss.item(), "heldout": _held_loss(model, held)}
            state["log"].append(entry)
            print(json.dumps(entry), flush=True)
        if time.time() - last_save > 300 or state["step"] == state["total"]:
            torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "state": state}, ckpt)
            last_save = time.time()


def _held_loss(model, held: np.ndarray, seq: int = 256, batches: int = 4) -> float:
    import torch

    rng = np.random.default_rng(1234)
    with torch.no_grad():
        return float(
            np.mean(
                [
                    model(
                        input_ids=(b := _batch(held, rng, 8, seq))[:, :-1], labels=b[:, :-1]
                    ).loss.item()
                    for _ in range(batches)
                ]
            )
        )


def _mlx_spec(*args: str) -> None:
    subprocess.run([sys.executable, "-m", "mlx_spec.cli", *args], check=True)


def stage_convert(args) -> None:
    _mlx_spec(
        "convert",
        "--hf-path",
        str(WORK / "target-hf"),
        "--mlx-path",
        str(WORK / "target-mlx"),
        "--dtype",
        "float32",
        "--force",
    )


def _heldout_dir() -> Path:
    """The held-out files copied into one folder (for --holdout)."""
    folder = WORK / "heldout"
    folder.mkdir(parents=True, exist_ok=True)
    for path in stdlib_files()[1]:
        shutil.copy(path, folder / path.name)
    return folder


def _train_dir() -> Path:
    folder = WORK / "train-text"
    if not folder.exists():
        folder.mkdir(parents=True)
        for i, path in enumerate(stdlib_files()[0]):
            shutil.copy(path, folder / f"{i:04d}_{path.name}")
    return folder


def _distill(args, model: Path, out: str, *extra: str) -> None:
    """`mlx-spec distill` on the training files, evaluated on the held-out ones."""
    _mlx_spec(
        "distill",
        *("--model", str(model), "--out", str(WORK / out)),
        *("--data", str(_train_dir()), "--holdout", str(_heldout_dir())),
        *("--steps", str(args.distill_steps), "--seq-len", "256"),
        *("--batch-size", str(args.distill_batch), "--lr", str(args.distill_lr)),
        *("--target-tokens", str(args.target_tokens), "--target-batch", str(args.target_batch)),
        "--force",
        *extra,
    )


def stage_draft(args) -> None:
    _distill(args, WORK / "target-mlx", "draft-mlx", "--hidden-size", "256", "--layers", "2")


def stage_mtp(args) -> None:
    _distill(args, WORK / "target-mlx", "mtp-mlx", "--kind", "mtp", "--mtp-family", "mimo")


def stage_refine(args) -> None:
    """Train the shipped pair's drafters further: each starts from the shipped weights and
    trains on the training files plus the target's own continuations of them (generated
    once, shared by both runs through the data cache `mlx-spec distill` resumes from)."""
    import mlx_spec
    from mlx_spec.embedded import converted_pair
    from mlx_spec.training.distill import DATA_CACHE, prepare_data

    target, draft = converted_pair()
    shared = WORK / "refine-data"
    if not (shared / DATA_CACHE).is_file():
        model, tokenizer = mlx_spec.load(str(target))
        prepare_data(
            model,
            tokenizer,
            shared,
            (str(_train_dir()),),
            (str(_heldout_dir()),),
            0,
            0,
            args.target_tokens,
            args.target_batch,
        )
    runs = {
        "mtp-mlx": ["--kind", "mtp", "--mtp-family", "mimo", "--init", str(target)],
        "draft-mlx": ["--init", str(draft)],
    }
    for out, extra in runs.items():
        if (WORK / out / "distill.json").is_file():  # finished: `rm -r` it to train again
            print(f"{out}: already distilled")
            continue
        if not (WORK / out / ".distill-checkpoint").exists():
            (WORK / out).mkdir(parents=True, exist_ok=True)
            shutil.copy(shared / DATA_CACHE, WORK / out / DATA_CACHE)
        _distill(args, target, out, *extra)


def stage_medusa(args) -> None:
    """Medusa heads distilled for the shipped target (`mlx-spec distill --kind medusa`), then
    bundled into the shipped target as `model-medusa.safetensors` (`medusa_head.*`, float16),
    which `mlx-spec convert` carries into the converted target's `medusa/`."""
    from mlx_spec.embedded import converted_pair

    import mlx.core as mx

    target, _ = converted_pair()
    out = WORK / "medusa-mlx"
    if not (out / "distill.json").is_file():
        _distill(args, target, "medusa-mlx", "--kind", "medusa", "--heads", str(args.heads))
    heads = mx.load(str(out / "medusa_lm_head.safetensors"))
    bundled = {f"medusa_head.{k}": v.astype(mx.float16) for k, v in heads.items()}
    mx.save_safetensors(str(OUT / "target" / "model-medusa.safetensors"), bundled)
    record = OUT / "training.json"
    log = json.loads(record.read_text())
    log["medusa"] = json.loads((out / "distill.json").read_text())
    record.write_text(json.dumps(log, indent=1) + "\n")


def stage_eagle3(args) -> None:
    """An EAGLE-3 head distilled for the shipped target, shipped in the EAGLE repository's
    layout (`midlayer.*`, float16) with its config in `demo_pair/eagle3/`."""
    from mlx_spec.embedded import converted_pair

    target, _ = converted_pair()
    out = WORK / "eagle3-mlx"
    if not (out / "distill.json").is_file():
        _distill(args, target, "eagle3-mlx", "--kind", "eagle3")
    config = json.loads((out / "config.json").read_text())
    published = {
        "architectures": ["LlamaForCausalLMEagle3"],
        "model_type": "llama",
        "hidden_size": config["hidden_size"],
        "intermediate_size": config["intermediate_size"],
        "num_attention_heads": config["num_attention_heads"],
        "num_key_value_heads": config["num_key_value_heads"],
        "head_dim": config["head_dim"],
        "num_hidden_layers": 1,
        "rms_norm_eps": config["rms_norm_eps"],
        "rope_theta": config["rope_theta"],
        "max_position_embeddings": config["max_position_embeddings"],
        "vocab_size": config["vocab_size"],
        "draft_vocab_size": config["draft_vocab_size"],
        "torch_dtype": "float16",
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": config["layer_ids"]},
    }
    _ship(out, OUT / "eagle3", published, "eagle3")


def stage_dflash(args) -> None:
    """A DFlash block drafter distilled for the shipped target, shipped in z-lab's layout
    (a Qwen3 config with `dflash_config`, float16) in `demo_pair/dflash/`."""
    from mlx_spec.embedded import converted_pair

    target, _ = converted_pair()
    out = WORK / "dflash-mlx"
    if not (out / "distill.json").is_file():
        _distill(args, target, "dflash-mlx", "--kind", "dflash", "--layers", "2")
    config = json.loads((out / "config.json").read_text())
    published = {
        "architectures": ["DFlashDraftModel"],
        "model_type": "qwen3",
        "hidden_size": config["hidden_size"],
        "intermediate_size": config["intermediate_size"],
        "num_hidden_layers": config["num_layers"],
        "num_attention_heads": config["num_attention_heads"],
        "num_key_value_heads": config["num_key_value_heads"],
        "head_dim": config["head_dim"],
        "rms_norm_eps": config["rms_norm_eps"],
        "rope_theta": config["rope_theta"],
        "max_position_embeddings": config["max_position_embeddings"],
        "vocab_size": VOCAB,
        "torch_dtype": "float16",
        "num_target_layers": TARGET["num_hidden_layers"],
        "dflash_config": {
            "target_layer_ids": config["target_layer_ids"],
            "mask_token_id": config["mask_token_id"],
            "block_size": config["block_size"],
        },
    }
    _ship(out, OUT / "dflash", published, "dflash")


def _ship(out: Path, dest: Path, config: dict, name: str) -> None:
    """A distilled drafter's weights (float16) and its published config into the pair, and
    its distillation log into training.json."""
    import mlx.core as mx

    shutil.rmtree(dest, ignore_errors=True)
    dest.mkdir(parents=True)
    weights = mx.load(str(out / "model.safetensors"))
    mx.save_safetensors(
        str(dest / "model.safetensors"),
        {k: v.astype(mx.float16) if mx.issubdtype(v.dtype, mx.floating) else v
         for k, v in weights.items()},
    )  # fmt: skip
    (dest / "config.json").write_text(json.dumps(config, indent=1) + "\n")
    record = OUT / "training.json"
    log = json.loads(record.read_text())
    log[name] = json.loads((out / "distill.json").read_text())
    record.write_text(json.dumps(log, indent=1) + "\n")


def stage_export(args) -> None:
    from export_embedded_pair import export  # kept beside this script

    export(WORK, OUT)


STAGES = {
    "tokenizer": stage_tokenizer,
    "target": stage_target,
    "convert": stage_convert,
    "draft": stage_draft,
    "mtp": stage_mtp,
}
EXTRA = {
    "refine": stage_refine,
    "medusa": stage_medusa,
    "eagle3": stage_eagle3,
    "dflash": stage_dflash,
    "export": stage_export,
}


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("stage", choices=[*STAGES, *EXTRA, "all"])
    parser.add_argument("--minutes", type=float, default=60, help="target training budget")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument(
        "--total-steps",
        type=int,
        default=0,
        help="target training steps (default: as many as --minutes allow)",
    )
    parser.add_argument("--lr", type=float, default=2e-3)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--distill-steps", type=int, default=1500)
    parser.add_argument("--distill-lr", type=float, default=1e-3)
    parser.add_argument(
        "--target-tokens",
        type=int,
        default=0,
        help="tokens of the target's own continuations added to the distillation data",
    )
    parser.add_argument(
        "--target-batch", type=int, default=16, help="rows the target continues at once"
    )
    parser.add_argument("--distill-batch", type=int, default=8, help="distillation batch size")
    parser.add_argument("--heads", type=int, default=3, help="medusa: Medusa heads")
    args = parser.parse_args()
    WORK.mkdir(parents=True, exist_ok=True)
    stages = {**STAGES, **EXTRA}
    for name in [*STAGES, "export"] if args.stage == "all" else [args.stage]:
        print(f"== {name}", flush=True)
        stages[name](args)


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).parent))
    main()
