"""Distill a drafter for a target: a small draft model, an MTP head, Medusa heads or an
EAGLE-3 head, trained to match the frozen target's next-token distribution
(KL(target || drafter)) on text.

Training is resumable: a checkpoint (weights, optimizer state, step) is written every
`checkpoint_every` steps and on Ctrl-C; batches are a pure function of (seed, step), so a resumed
run sees exactly the batches an uninterrupted one would.
"""

from __future__ import annotations

import json
import shutil
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from mlx_spec.caches.taps import find_head
from mlx_spec.core.compat import copy_tokenizer_files, scored_vocab
from mlx_spec.drafters.dflash import DFlashDrafter
from mlx_spec.drafters.eagle3 import Eagle3Drafter
from mlx_spec.drafters.medusa import (
    MedusaDrafter,
    MedusaHeads,
    load_medusa_heads,
    save_medusa_heads,
)
from mlx_spec.drafters.mtp import MTPDrafter, save_mtp_drafter
from mlx_spec.models.dflash import dflash_for, save_dflash, train_logits, training_anchors
from mlx_spec.models.eagle3 import eagle3_for, save_eagle3
from mlx_spec.models.mtp import MTPModule, target_layers
from mlx_spec.training.data import (
    TokenData,
    encode_files,
    generate_tokens,
    target_text,
    text_files,
)
from mlx_spec.training.teacher import TeacherCache, TopK, kl_to_teacher, windows_of

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
import numpy as np
from mlx.utils import tree_flatten, tree_unflatten
from mlx_lm.utils import _get_classes, save_config, save_model
from tqdm import tqdm

KINDS = ("draft-model", "mtp", "medusa", "eagle3", "dflash")
CHECKPOINT = ".distill-checkpoint"
TTT_STEPS = 3  # EAGLE-3: drafting steps unrolled in training


@dataclass(frozen=True)
class DistillConfig:
    """Settings of one distillation run (recorded in the checkpoint and the output)."""

    kind: str = "draft-model"
    steps: int = 300
    batch_size: int = 8
    seq_len: int = 128
    learning_rate: float = 1e-3
    checkpoint_every: int = 50
    seed: int = 0
    hidden_size: int = 128  # draft model only
    num_layers: int = 2  # draft model and DFlash
    mtp_family: str = "mimo"  # MTP only: the published layout to store it in
    heads: int = 3  # Medusa only: heads (each guesses one position further)

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ValueError(f"kind must be one of {', '.join(KINDS)}, got {self.kind!r}")
        for name in (
            "steps",
            "batch_size",
            "seq_len",
            "checkpoint_every",
            "hidden_size",
            "num_layers",
            "heads",
        ):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        if not self.learning_rate > 0:
            raise ValueError(f"learning_rate must be > 0, got {self.learning_rate}")


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
        return _load_student(target, target_config, config, init)
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


def _load_student(target: nn.Module, target_config: dict, config: DistillConfig, init: Path):
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


class Distiller:
    """Trains a student to match a frozen target's cached answers (`TeacherCache`)."""

    def __init__(self, target: nn.Module, student: nn.Module, config: DistillConfig):
        self.target, self.student, self.config = target, student, config
        # the target layers whose features the student reads (L: the final normed state)
        self.layers: tuple[int, ...] = ()
        if config.kind in ("mtp", "medusa"):
            self.layers = (len(target_layers(target)),)
        elif config.kind == "eagle3":
            self.layers = tuple(student.cfg.layer_ids)
        elif config.kind == "dflash":
            self.layers = tuple(student.hidden_layers)
        ids = getattr(student, "target_ids", None) if config.kind == "eagle3" else None
        self.t2d = None  # target id -> draft index, for a head over a reduced vocabulary
        if ids is not None:
            t2d = np.full(student.cfg.vocab_size, -1, np.int32)
            t2d[np.array(ids)] = np.arange(ids.size, dtype=np.int32)
            self.t2d = mx.array(t2d)
        self.target.freeze()
        warmup = max(1, config.steps // 20)
        schedule = optim.join_schedules(
            [
                optim.linear_schedule(1e-7, config.learning_rate, warmup),
                optim.cosine_decay(config.learning_rate, max(1, config.steps - warmup)),
            ],
            [warmup],
        )
        self.optimizer = optim.AdamW(learning_rate=schedule, weight_decay=0.0)
        self._grad = nn.value_and_grad(student, self._loss)

    def _kl(self, teacher: TopK, logits: mx.array) -> mx.array:
        return kl_to_teacher(teacher, logits, self.t2d)

    def _loss(
        self, tokens: mx.array, teacher: TopK, hidden: mx.array | None, unroll: bool = True
    ) -> mx.array:
        """The training loss (`unroll=False`: the first drafting step alone, the held-out KL
        every kind reports alike)."""
        if self.config.kind == "draft-model":
            return self._kl(teacher, self.student(tokens))
        if self.config.kind == "dflash":
            # Draft i of the block at a guesses the token at a + i: the target's
            # distribution for it is at a + i - 1.
            logits = train_logits(self.student, tokens, hidden)
            block = self.student.cfg.block_size
            starts = training_anchors(tokens.shape[1], block)
            rows = mx.array([[a + i for i in range(block - 1)] for a in starts])
            return self._kl(teacher[:, rows], logits)
        if self.config.kind == "medusa":
            # Head k reads h_p and guesses t_{p+2+k}, whose target distribution is at p+1+k.
            logits = self.student(hidden)  # [K, B, S, V]
            losses = [
                self._kl(teacher[:, k + 1 :], logits[k, :, : -(k + 1)])
                for k in range(logits.shape[0])
            ]
            return mx.stack(losses).mean()
        # MTP and EAGLE-3: the pair (h_p, t_{p+1}) (h: the layers' features for EAGLE-3)
        # predicts t_{p+2}, whose target distribution is at p+1.
        logits = self._student(tokens[:, 1:], hidden[:, :-1])
        loss = self._kl(teacher[:, 1:], logits)
        if self.config.kind != "eagle3" or not unroll:
            return loss
        # EAGLE-3's training-time test: step i + 1 feeds back step i's outputs, as drafting
        # does (here every position is self-fed: the sequence-wide approximation), the
        # pair (y_p, t_{p+i+1}) guessing t_{p+i+2}; the steps weigh 0.8 ** i.
        total, weight = loss, 1.0
        for step in range(1, TTT_STEPS):
            fed = self.student.feedback[:, :-1]
            logits = self._student(tokens[:, step + 1 :], fed)
            weight *= 0.8
            total = total + weight * self._kl(teacher[:, step + 1 :], logits)
        return total

    def _student(self, tokens: mx.array, hidden: mx.array) -> mx.array:
        if self.t2d is not None:  # the head's own (draft vocabulary) logits
            return self.student(tokens, cache=[None], hidden=hidden, full=False)
        return self.student(tokens, cache=[None], hidden=hidden)

    def step(self, batch: tuple) -> float:
        """One optimizer step on a batch of (tokens, teacher, features)."""
        loss, grads = self._grad(*batch)
        self.optimizer.update(self.student, grads)
        mx.eval(loss, self.student.parameters(), self.optimizer.state)
        return loss.item()

    def evaluate(self, teacher: TeacherCache, batch_size: int) -> float:
        """Mean KL(target || student) on the held-out windows (over the teacher's top K)."""
        losses = []
        for start in range(0, len(teacher.windows), batch_size):
            indices = np.arange(start, min(start + batch_size, len(teacher.windows)))
            losses.append(self._loss(*teacher.batch(indices), unroll=False).item())
        return float(np.mean(losses)) if losses else float("nan")


def batch_indices(step: int, windows: int, batch_size: int, seed: int) -> np.ndarray:
    """The windows of training step `step`: a function of (seed, step) alone, so a resumed run
    sees exactly the batches an uninterrupted one would."""
    return np.random.default_rng((seed, 0, step)).integers(0, windows, size=batch_size)


def save_checkpoint(path: Path, distiller: Distiller, step: int) -> None:
    """Weights, optimizer state and step, written to a temp dir and renamed."""
    tmp = path.with_name(path.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    mx.save_safetensors(
        str(tmp / "student.safetensors"), dict(tree_flatten(distiller.student.parameters()))
    )
    state = dict(tree_flatten(distiller.optimizer.state))
    mx.save_safetensors(
        str(tmp / "optimizer.safetensors"),
        {k: v for k, v in state.items() if isinstance(v, mx.array)},
    )
    meta = {"step": step, "config": asdict(distiller.config)}
    (tmp / "state.json").write_text(json.dumps(meta))
    shutil.rmtree(path, ignore_errors=True)
    tmp.rename(path)


def load_checkpoint(path: Path, distiller: Distiller) -> int:
    """Restore weights and optimizer state; returns the step to continue from."""
    meta = json.loads((path / "state.json").read_text())
    if meta["config"] != asdict(distiller.config):
        raise ValueError(f"{path}: checkpoint was made with other settings; use a new --out")
    distiller.student.load_weights(str(path / "student.safetensors"))
    distiller.optimizer.init(distiller.student.trainable_parameters())
    saved = mx.load(str(path / "optimizer.safetensors"))
    distiller.optimizer.state = tree_unflatten(list(saved.items()))
    return meta["step"]


def train(
    distiller: Distiller, teacher: TeacherCache, checkpoint: Path, progress: bool = True
) -> int:
    """Run (or resume) training to `config.steps` on the cached teacher's windows; returns the
    steps done in total."""
    config = distiller.config
    start = load_checkpoint(checkpoint, distiller) if (checkpoint / "state.json").exists() else 0
    bar = tqdm(total=config.steps, initial=start, desc="distill", disable=not progress, unit="step")
    step, tic = start, time.perf_counter()
    try:
        while step < config.steps:
            indices = batch_indices(step, len(teacher.windows), config.batch_size, config.seed)
            loss = distiller.step(teacher.batch(indices))
            step += 1
            rate = config.batch_size * config.seq_len * (step - start) / (time.perf_counter() - tic)
            bar.set_postfix(loss=f"{loss:.4f}", tok_s=f"{rate:.0f}")
            bar.update(1)
            if step % config.checkpoint_every == 0 or step == config.steps:
                save_checkpoint(checkpoint, distiller, step)
    except KeyboardInterrupt:
        save_checkpoint(checkpoint, distiller, step)  # nothing lost: resume continues here
        raise
    finally:
        bar.close()
    return step


def write_drafter(
    out: Path, distiller: Distiller, student_cfg: dict, target_dir: Path, report: dict
) -> None:
    """Write the drafter directory `mlx-spec generate` loads (atomically)."""
    tmp = out.with_name(out.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    if distiller.config.kind == "draft-model":
        save_model(tmp, distiller.student)
        save_config(dict(student_cfg), config_path=tmp / "config.json")
        copy_tokenizer_files(target_dir, tmp)
    elif distiller.config.kind == "medusa":
        save_medusa_heads(distiller.student, tmp)
    elif distiller.config.kind == "eagle3":
        student = distiller.student
        weights = dict(tree_flatten(student.parameters()))
        if student.target_ids is not None:  # draft index i drafts target id i + d2t[i]
            size = student.cfg.draft_vocab_size
            weights["d2t"] = student.target_ids - mx.arange(size, dtype=mx.int32)
        save_eagle3(tmp, student.cfg, weights, mx.float32)
    elif distiller.config.kind == "dflash":
        student = distiller.student
        save_dflash(tmp, student.cfg, dict(tree_flatten(student.parameters())), mx.float32)
    else:
        save_mtp_drafter(tmp, distiller.student, student_cfg)
    (tmp / "distill.json").write_text(json.dumps(report, indent=2))
    keep = {CHECKPOINT, DATA_CACHE, BEFORE, TEACHER_CACHE, "answers.jsonl"}
    if out.exists():
        for child in out.iterdir():
            if child.name not in keep:
                shutil.rmtree(child) if child.is_dir() else child.unlink()
    out.mkdir(parents=True, exist_ok=True)
    for child in tmp.iterdir():
        child.rename(out / child.name)
    tmp.rmdir()


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


def heldout_acceptance(
    target,
    tokenizer,
    drafter,
    prompts: list[list[int]],
    temperature: float,
    k: int = 4,
    max_tokens: int = 32,
) -> tuple[float, float]:
    """(acceptance rate, acceptance at the first draft position) of `drafter` over held-out
    prompts (seeded, so repeatable)."""
    from mlx_spec.api import generate
    from mlx_spec.core.stats import merge_stats

    runs = []
    for i, prompt in enumerate(prompts):
        stats = generate(
            target,
            tokenizer,
            prompt,
            drafter=drafter,
            num_draft=k,
            max_tokens=max_tokens,
            temperature=temperature,
            seed=i,
        ).stats
        runs.append(stats)
    total = merge_stats(runs)
    first = total.acceptance_by_position[:1]
    return total.acceptance_rate, first[0] if first else 0.0


def measure(distiller: Distiller, tokenizer, heldout: TokenData, teacher: TeacherCache) -> dict:
    """Held-out KL and acceptance (greedy and temperature 1) of the student as it stands."""
    drafter = drafter_for(distiller, tokenizer)
    prompts = heldout.prompts(8, 32)
    report = {"heldout_kl": distiller.evaluate(teacher, distiller.config.batch_size)}
    for name, temperature in (("greedy", 0.0), ("t1", 1.0)):
        rate, first = heldout_acceptance(distiller.target, tokenizer, drafter, prompts, temperature)
        report[f"acceptance_{name}"] = rate
        report[f"acceptance_first_{name}"] = first
    return report


DATA_CACHE = ".distill-data.npz"
BEFORE = ".distill-before.json"  # the untrained drafter's scores, kept for a resumed run


def prepare_data(
    target,
    tokenizer,
    out_dir: Path,
    data_paths,
    holdout_paths,
    generate: int,
    seed: int,
    target_tokens: int = 0,
    target_batch: int = 16,
    chat: ChatData | None = None,
) -> tuple[TokenData, TokenData]:
    """Training and held-out tokens, cached in `out_dir` so a resumed run uses the same ones.

    With `chat`, the target's answers to chat prompts (each with its prompt, through the chat
    template; the last tenth of the prompts held out). Otherwise without data paths the target
    writes `generate` tokens itself; without held-out paths the last tenth of the training
    tokens is held out (and never trained on). With data paths and `target_tokens`, the
    target's own continuations of windows of the training data are added.
    """
    cache = out_dir / DATA_CACHE
    if cache.exists():
        saved = np.load(cache)
        return TokenData(saved["train"], seed), TokenData(saved["heldout"], seed)
    if chat is not None:
        train, heldout = chat.tokens(target, tokenizer, seed)
    else:
        if data_paths:
            train = encode_files(text_files(data_paths), tokenizer)
        else:
            train = generate_tokens(target, tokenizer, generate, seed)
        if holdout_paths:
            heldout = encode_files(text_files(holdout_paths), tokenizer)
        else:
            cut = int(train.size * 0.9)
            train, heldout = train[:cut], train[cut:]
    if data_paths and target_tokens > 0:
        vocab = scored_vocab(target, tokenizer)
        own = target_text(target, train, target_tokens, seed, tokenizer, vocab, target_batch)
        train = np.concatenate([train, own])
    out_dir.mkdir(parents=True, exist_ok=True)
    np.savez(cache, train=train, heldout=heldout)
    return TokenData(train, seed), TokenData(heldout, seed)


@dataclass(frozen=True)
class ChatData:
    """Train on the target's own answers to chat prompts.

    Attributes:
        prompts: file of prompts (JSON lines with "prompt", or one per line).
        answers: JSON-lines file the answers are kept in (several runs can share it).
        temperatures: each prompt is answered once at each.
        max_tokens: tokens per answer at most.
        batch: answers written at once.
    """

    prompts: str
    answers: str
    temperatures: tuple[float, ...] = (0.0, 0.7)
    max_tokens: int = 256
    batch: int = 32

    def tokens(self, target, tokenizer, seed: int) -> tuple[np.ndarray, np.ndarray]:
        """(training tokens, held-out tokens): the answers to the first nine tenths of the
        prompts, and to the rest."""
        from mlx_spec.training.chat_data import answer_tokens, read_prompts, write_answers

        prompts = read_prompts(self.prompts)
        records = write_answers(
            target, tokenizer, prompts, self.answers, temperatures=self.temperatures,
            max_tokens=self.max_tokens, batch=self.batch, seed=seed,
        )  # fmt: skip
        cut = max(1, int(len(prompts) * 0.9))
        eos = sorted(tokenizer.eos_token_ids)[0] if tokenizer.eos_token_ids else None
        train = answer_tokens([r for r in records if r["index"] < cut], eos)
        heldout = answer_tokens([r for r in records if r["index"] >= cut], eos)
        return train, heldout


TEACHER_CACHE = ".distill-teacher"
HELDOUT_WINDOWS = 4  # held-out batches the KL is measured on


def _teachers(distiller: Distiller, target, tokenizer, data, heldout, folder: Path):
    """The teacher caches (in `folder`) of the training windows (at most as many as the steps
    will read) and of the held-out windows."""
    config = distiller.config
    vocab = scored_vocab(target, tokenizer)
    seq = config.seq_len
    train = windows_of(data.tokens, seq, most=config.steps * config.batch_size)
    held = windows_of(heldout.tokens, min(seq, heldout.tokens.size))
    held = held[: HELDOUT_WINDOWS * config.batch_size]
    return (
        TeacherCache(folder / "train", train, distiller.layers, vocab),
        TeacherCache(folder / "heldout", held, distiller.layers, vocab),
    )


def run_distill(
    target_dir: str,
    out: str,
    config: DistillConfig,
    *,
    data_paths: tuple = (),
    holdout_paths: tuple = (),
    generate: int = 50_000,
    target_tokens: int = 0,
    target_batch: int = 16,
    init: str | None = None,
    progress: bool = True,
    force: bool = False,
    chat: ChatData | None = None,
    draft_vocab: int | None = None,
    teacher_cache: str | None = None,
    teacher_layers: tuple[int, ...] = (),
) -> dict:
    """Distill a drafter for the target at `target_dir` into `out`; returns the report.

    Resumes from `out`'s checkpoint when one exists; writes the drafter directory (loadable by
    `mlx-spec generate --draft-model OUT` or `--mtp OUT`) and `distill.json` at the end.

    Args:
        target_tokens: with `data_paths`, also train on about this many tokens of the target's
            own continuations of windows of the data (half greedy, half sampled).
        target_batch: rows the target continues at once while writing them.
        init: a drafter directory to train further instead of starting from scratch.
        chat: train on the target's answers to chat prompts instead.
        draft_vocab: EAGLE-3 only: the head's output vocabulary, the most frequent target
            tokens of the training text (None: the whole vocabulary).
        teacher_cache: where the teacher's answers are kept (default: inside `out`, removed
            at the end); a folder shared by drafters trained on the same text and settings
            is computed once.
        teacher_layers: also keep these target layers' features in it (Hugging Face
            `hidden_states` ids; L: the final state), for another drafter that will read them.
    """
    from mlx_spec.loading import load

    out_dir = Path(out)
    checkpoint = out_dir / CHECKPOINT
    if out_dir.exists() and any(out_dir.iterdir()) and not checkpoint.exists() and not force:
        raise ValueError(
            f"{out}: already exists and holds no unfinished run to resume "
            "(use --force to overwrite it)"
        )
    target, tokenizer = load(target_dir)
    data, heldout = prepare_data(
        target,
        tokenizer,
        out_dir,
        data_paths,
        holdout_paths,
        generate,
        config.seed,
        target_tokens,
        target_batch,
        chat,
    )
    counts = None
    if draft_vocab is not None:
        counts = np.bincount(data.tokens, minlength=scored_vocab(target, tokenizer))
    student, student_cfg = build_student(
        target, target_text_config(Path(target_dir)), config, None if init is None else Path(init),
        counts=counts, draft_vocab=draft_vocab,
    )  # fmt: skip
    distiller = Distiller(target, student, config)
    folder = Path(teacher_cache) if teacher_cache else out_dir / TEACHER_CACHE
    teacher, heldout_teacher = _teachers(distiller, target, tokenizer, data, heldout, folder)
    teacher.fill(target, progress, also=teacher_layers)
    heldout_teacher.fill(target, progress, also=teacher_layers)
    tic = time.perf_counter()
    before_file = out_dir / BEFORE
    if checkpoint.exists():  # resumed: the first run measured the untrained drafter
        before = json.loads(before_file.read_text()) if before_file.is_file() else None
    else:
        before = measure(distiller, tokenizer, heldout, heldout_teacher)
        out_dir.mkdir(parents=True, exist_ok=True)
        before_file.write_text(json.dumps(before))
    steps = train(distiller, teacher, checkpoint, progress)
    after = measure(distiller, tokenizer, heldout, heldout_teacher)
    report = {
        "kind": config.kind,
        "steps": steps,
        "config": asdict(config),
        "train_tokens": len(data),
        "heldout_tokens": len(heldout),
        "target_tokens": target_tokens,
        "target_batch": target_batch,
        "init": init,
        "seconds": time.perf_counter() - tic,
        "before": before,
        "after": after,
    }
    write_drafter(out_dir, distiller, student_cfg, Path(target_dir), report)
    shutil.rmtree(checkpoint, ignore_errors=True)
    if not teacher_cache:
        shutil.rmtree(out_dir / TEACHER_CACHE, ignore_errors=True)
    (out_dir / DATA_CACHE).unlink(missing_ok=True)
    before_file.unlink(missing_ok=True)
    return report
