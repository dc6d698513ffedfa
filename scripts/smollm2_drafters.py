"""Train the drafters shipped for SmolLM2-135M-Instruct (`--model smollm2`), by
self-distillation: the model answers chat prompts, and each drafter learns to match its
distribution on those answers (`mlx-spec distill --prompts`). No downloads: the prompts are built
from `scripts/prompts/train_topics.json` (topics and templates disjoint from the benchmark's
`benchmarks/prompts/chat.jsonl`).

Stages (each resumable; in order, or `all`):
  prompts   questions, stories, code tasks and requests for a passage; then edit prompts that
            ask to rewrite the passages the model wrote (so the edit prompts quote its own text)
  answers   the model's answers to all of them, greedy and at T = 0.7 (one file, shared)
  eagle3    an EAGLE-3 head over the model's 8192 most frequent tokens
  mtp       an MTP head (MiMo layout: one decoder layer over [embedding, hidden state])
  draft     a small draft model (llama layout, the model's tokenizer)
            (the three share one pass of the target over the text: `--teacher-cache`)
            (`--more --steps N --lr LR`: N more steps from the drafter already there)
  ship      each drafter of SHIPPED cast to float16 into `mlx_spec/trained/smollm2/<kind>/`

    python scripts/smollm2_drafters.py all --work /tmp/smollm2-drafters

The log of the shipped run is `scripts/smollm2_drafters.log`.
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TOPICS = ROOT / "scripts" / "prompts" / "train_topics.json"
SHIP = ROOT / "mlx_spec" / "trained" / "smollm2"
MODEL = "smollm2"

# kind -> distill flags; the EAGLE-3 head runs first and keeps the final state's features
# (hidden_states[30]) in the shared teacher folder for the MTP head, so the target reads the
# text once for all three
DRAFTERS = {
    "eagle3": ["--kind", "eagle3", "--draft-vocab", "8192", "--teacher-layers", "30"],
    "mtp": ["--kind", "mtp", "--mtp-family", "mimo"],
    "draft": ["--kind", "draft-model", "--hidden-size", "256", "--layers", "4"],
}
STEPS = {"eagle3": 400, "mtp": 150, "draft": 250}  # training steps of each (--steps: all)
# shipped by the `ship` stage: the MTP head, after its 150 steps, keeps 7% of its first drafts
# (greedy) against the EAGLE-3 head's 34%, too few to pay for itself inside `auto`
SHIPPED = ("eagle3", "draft")


def log(message: str) -> None:
    print(f"[smollm2] {time.strftime('%H:%M:%S')} {message}", flush=True)


def first_prompts(seed: int, questions: int, stories: int, passages: int) -> list[str]:
    """Questions, stories, every code task and passage requests, shuffled by `seed`."""
    spec = json.loads(TOPICS.read_text())
    rng = random.Random(seed)

    def pick(templates, count):
        pairs = [(t, topic) for t in templates for topic in spec["topics"]]
        return [t.format(topic=topic) for t, topic in rng.sample(pairs, count)]

    prompts = pick(spec["question_templates"], questions) + pick(spec["story_templates"], stories)
    prompts += list(spec["code_tasks"]) + pick(spec["passage_requests"], passages)
    rng.shuffle(prompts)
    return prompts


def edit_prompts(work: Path, seed: int) -> list[str]:
    """An edit instruction for each passage the model wrote (at either temperature), cut after
    its last full sentence."""
    from mlx_spec import load

    spec = json.loads(TOPICS.read_text())
    _, tokenizer = load(MODEL)
    first = [json.loads(line)["prompt"] for line in (work / "first.jsonl").read_text().splitlines()]
    rng = random.Random(seed + 1)
    out = []
    for line in (work / "first-answers.jsonl").read_text().splitlines():
        record = json.loads(line)
        prompt = first[record["index"]]
        if not _is_passage_request(prompt, spec):
            continue
        passage = _whole_sentences(tokenizer.decode(record["answer_ids"]).strip())
        if 30 <= len(passage.split()) <= 220:
            out.append(f"{rng.choice(spec['edit_instructions'])}\n\n{passage}")
    return out


def _whole_sentences(text: str) -> str:
    """`text` up to its last sentence end (an answer cut by the token budget ends mid-way)."""
    end = max(text.rfind(mark) for mark in (".", "!", "?"))
    return text[: end + 1] if end > 0 else text


def _is_passage_request(prompt: str, spec: dict) -> bool:
    for template in spec["passage_requests"]:
        head, _, tail = template.partition("{topic}")
        if prompt.startswith(head) and prompt.endswith(tail):
            return True
    return False


def write_jsonl(path: Path, prompts: list[str]) -> None:
    path.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in prompts))


def distill(
    work: Path, args, kind: str, extra: list[str], out: Path, prompts: Path, answers: Path
) -> None:
    cmd = [
        sys.executable, "-m", "mlx_spec.cli", "distill", "--model", MODEL, "--out", str(out),
        "--prompts", str(prompts), "--answers", str(answers),
        "--answer-tokens", str(args.answer_tokens), "--steps", str(args.steps or STEPS[kind]),
        "--teacher-cache", str(work / "teacher"),
        "--batch-size", str(args.batch_size), "--seq-len", str(args.seq_len),
        "--lr", str(args.lr), *extra,
    ]  # fmt: skip
    log(" ".join(cmd[2:]))
    subprocess.run(cmd, check=True)


def stage_prompts(work: Path, args) -> None:
    prompts = first_prompts(args.seed, args.questions, args.stories, args.passages)
    prompts = prompts[: args.first]
    write_jsonl(work / "first.jsonl", prompts)
    log(f"{len(prompts)} first prompts")


def stage_answers(work: Path, args) -> None:
    """First the first prompts' answers; then the edit prompts built from the passages; the
    training prompts are both, their answers in one file."""
    from mlx_spec import load
    from mlx_spec.training.chat_data import read_prompts, write_answers

    model, tokenizer = load(MODEL)
    first = read_prompts(work / "first.jsonl")
    temperatures, most = (0.0, 0.7), args.answer_tokens
    write_answers(model, tokenizer, first, work / "first-answers.jsonl",
                  temperatures=temperatures, max_tokens=most, seed=args.seed)  # fmt: skip
    edits = edit_prompts(work, args.seed)
    log(f"{len(edits)} edit prompts")
    every = first + edits
    random.Random(args.seed + 2).shuffle(every)
    write_jsonl(work / "train.jsonl", every)
    answers = work / "answers.jsonl"
    if not answers.exists():  # the first answers, renumbered into the shuffled order
        index = {p: i for i, p in enumerate(every)}
        with answers.open("w") as out:
            for line in (work / "first-answers.jsonl").read_text().splitlines():
                record = json.loads(line)
                record["index"] = index[first[record["index"]]]
                out.write(json.dumps(record) + "\n")
    write_answers(model, tokenizer, every, answers, temperatures=temperatures,
                  max_tokens=most, seed=args.seed)  # fmt: skip


def stage_drafter(kind: str, work: Path, args) -> None:
    """Train WORK/<kind>; with --more, train it a further --steps steps (`distill --init`), the
    result replacing it when done (the previous one kept as WORK/<kind>.before)."""
    prompts, answers = work / "train.jsonl", work / "answers.jsonl"
    if not args.more:
        distill(work, args, kind, DRAFTERS[kind], work / kind, prompts, answers)
        return
    more, before = work / f"{kind}.more", work / f"{kind}.before"
    distill(work, args, kind, [*DRAFTERS[kind], "--init", str(work / kind)], more, prompts, answers)
    shutil.rmtree(before, ignore_errors=True)
    (work / kind).rename(before)
    more.rename(work / kind)


def stage_ship(work: Path, args) -> None:
    """Each trained drafter cast to float16 into the package (its report beside it)."""
    import mlx.core as mx

    for kind in SHIPPED:
        source = work / kind
        if not (source / "config.json").is_file():
            log(f"{kind}: not trained, not shipped")
            continue
        dest = SHIP / kind
        shutil.rmtree(dest, ignore_errors=True)
        dest.mkdir(parents=True)
        for path in source.iterdir():
            if path.suffix == ".safetensors":
                tensors = mx.load(str(path))
                half = {
                    k: v.astype(mx.float16) if mx.issubdtype(v.dtype, mx.floating) else v
                    for k, v in tensors.items()
                }
                mx.save_safetensors(str(dest / path.name), half, metadata={"format": "mlx"})
            elif path.name in ("config.json", "distill.json", "model.safetensors.index.json"):
                shutil.copy(path, dest / path.name)
        log(f"{kind}: shipped to {dest}")


STAGES = ["prompts", "answers", "eagle3", "mtp", "draft", "ship"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("stage", choices=[*STAGES, "all"])
    parser.add_argument("--work", type=Path, required=True, help="working directory")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--questions", type=int, default=500)
    parser.add_argument("--stories", type=int, default=250)
    parser.add_argument("--passages", type=int, default=300)
    parser.add_argument(
        "--first", type=int, default=540, help="keep the first N of the shuffled prompts"
    )
    parser.add_argument("--answer-tokens", type=int, default=256)
    parser.add_argument("--steps", type=int, help="training steps of every drafter (see STEPS)")
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument(
        "--more", action="store_true", help="train the drafter already in WORK further"
    )
    args = parser.parse_args()
    args.work.mkdir(parents=True, exist_ok=True)
    for stage in STAGES if args.stage == "all" else [args.stage]:
        log(f"stage {stage}")
        if stage in DRAFTERS:
            stage_drafter(stage, args.work, args)
        else:
            globals()[f"stage_{stage}"](args.work, args)


if __name__ == "__main__":
    main()
