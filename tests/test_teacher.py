"""Distilling on a chat model's own answers, and the teacher's answers cached once: the answers
file resumes, the cache is shared between drafters, and its loss is the KL to the target."""

from __future__ import annotations

import json

import mlx_spec
from mlx_spec.training.chat_data import ChatData, read_prompts, write_answers
from mlx_spec.training.config import DistillConfig
from mlx_spec.training.distill import run_distill
from mlx_spec.training.teacher import TeacherCache, TopK, kl_to_teacher, windows_of

import mlx.core as mx
import numpy as np
import pytest
import tinymodels as tm
from conftest import VOCAB

SMALL = dict(batch_size=4, seq_len=32, learning_rate=3e-3, hidden_size=32, num_layers=1)
# the tiny tokenizer spells a..p, space and newline only
TEMPLATE = "{% for m in messages %}ab {{ m['content'] }}\n{% endfor %}pp "


@pytest.fixture(scope="module")
def chat_target(tmp_path_factory):
    """A tiny target whose tokenizer has a chat template."""
    root = tmp_path_factory.mktemp("chat-target")
    config = tm.llama_config(VOCAB, hidden_size=64, num_hidden_layers=2, intermediate_size=128)
    path = tm.write_checkpoint(root / "target", config, tm.random_weights(config, 5, scale=0.7))
    settings = json.loads((path / "tokenizer_config.json").read_text())
    settings["chat_template"] = TEMPLATE
    (path / "tokenizer_config.json").write_text(json.dumps(settings))
    return path


@pytest.fixture
def prompts(tmp_path):
    path = tmp_path / "prompts.jsonl"
    lines = [json.dumps({"prompt": "abc " * (1 + i % 3) + "def"}) for i in range(10)]
    path.write_text("\n".join(lines) + "\n")
    return path


def test_kl_over_the_whole_vocabulary_when_k_covers_it():
    """With K at least the vocabulary, the top-K loss is the KL itself; a draft vocabulary
    leaves out what it cannot draft."""
    rng = np.random.default_rng(0)
    teacher_logits = mx.array(rng.normal(size=(2, 5, 12)).astype(np.float32))
    student_logits = mx.array(rng.normal(size=(2, 5, 12)).astype(np.float32))
    p = teacher_logits - mx.logsumexp(teacher_logits, axis=-1, keepdims=True)
    q = student_logits - mx.logsumexp(student_logits, axis=-1, keepdims=True)
    want = (mx.exp(p) * (p - q)).sum(-1).mean()
    ids = mx.broadcast_to(mx.arange(12), (2, 5, 12))
    got = kl_to_teacher(TopK(ids, p), student_logits)
    assert abs(got.item() - want.item()) < 1e-5
    t2d = mx.array([0, 1, 2, -1, -1, -1, -1, -1, -1, -1, -1, -1])  # a draft vocabulary of 3
    draft = student_logits[..., :3]
    q3 = draft - mx.logsumexp(draft, axis=-1, keepdims=True)
    want3 = (mx.exp(p[..., :3]) * (p[..., :3] - q3)).sum(-1).mean()
    assert abs(kl_to_teacher(TopK(ids, p), draft, t2d).item() - want3.item()) < 1e-5


def test_answers_resume_where_they_stopped(chat_target, prompts, tmp_path):
    """Each prompt answered once per temperature, through the chat template; a second run
    keeps the answers already written and writes only the missing ones."""
    model, tokenizer = mlx_spec.load(str(chat_target))
    answers = tmp_path / "answers.jsonl"
    first = write_answers(model, tokenizer, read_prompts(prompts)[:4], answers,
                          temperatures=(0.0, 0.7), max_tokens=8, progress=False)  # fmt: skip
    assert len(first) == 8 and len(answers.read_text().splitlines()) == 8
    text = tokenizer.decode(first[0]["prompt_ids"])
    assert text.startswith("ab ") and text.endswith("\npp ")
    greedy = mlx_spec.generate(model, tokenizer, first[0]["prompt_ids"], max_tokens=8)
    assert first[0]["answer_ids"] == greedy.tokens
    again = write_answers(model, tokenizer, read_prompts(prompts), answers,
                          temperatures=(0.0, 0.7), max_tokens=8, progress=False)  # fmt: skip
    assert again[:8] == first and len(answers.read_text().splitlines()) == 20


@pytest.mark.parametrize("steps", [4, 1])
def test_drafters_share_one_teacher_pass(chat_target, prompts, tmp_path, monkeypatch, steps):
    """Two drafters trained on the same answers with one teacher folder: the first keeps the
    second's layers too (`teacher_layers`), so the second computes nothing, also when it
    trains for fewer steps (it would read fewer windows: it reads the folder's)."""
    shared = tmp_path / "teacher"
    chat = ChatData(str(prompts), str(tmp_path / "answers.jsonl"), (0.0,), max_tokens=16)
    final = 2  # the tiny target's final state: hidden_states[2]
    run_distill(str(chat_target), str(tmp_path / "eagle3"),
                DistillConfig(kind="eagle3", steps=4, **SMALL), chat=chat,
                teacher_cache=str(shared), teacher_layers=(final,), progress=False)  # fmt: skip
    stamps = {p: p.stat().st_mtime_ns for p in shared.rglob("chunk-*.npz")}
    assert stamps
    computed = []
    monkeypatch.setattr(TeacherCache, "_compute", lambda self, *a: computed.append(a))
    report = run_distill(str(chat_target), str(tmp_path / "mtp"),
                         DistillConfig(kind="mtp", steps=steps, **SMALL), chat=chat,
                         teacher_cache=str(shared), progress=False)  # fmt: skip
    assert not computed and stamps == {p: p.stat().st_mtime_ns for p in shared.rglob("chunk-*.npz")}
    assert report["train_tokens"] > 0 and report["steps"] == steps
    model, tokenizer = mlx_spec.load(str(chat_target))
    drafter = mlx_spec.load_mtp_drafter(str(tmp_path / "mtp"), model)
    spec = mlx_spec.generate(model, tokenizer, "abc def", drafter=drafter, max_tokens=12)
    assert spec.tokens == mlx_spec.generate(model, tokenizer, "abc def", max_tokens=12).tokens


def test_an_interrupted_teacher_pass_keeps_its_chunks(chat_target, tmp_path):
    """Chunks already on disk are not computed again."""
    model, _ = mlx_spec.load(str(chat_target))
    windows = windows_of(np.arange(3, 3 + 32 * 20, dtype=np.int32) % (VOCAB - 3) + 3, 32)
    cache = TeacherCache(tmp_path / "t", windows, (2,), VOCAB)
    cache.fill(model, progress=False)
    first = (tmp_path / "t" / "chunk-00000.npz").stat().st_mtime_ns
    (tmp_path / "t" / "chunk-00001.npz").unlink()
    again = TeacherCache(tmp_path / "t", windows, (2,), VOCAB)
    again.fill(model, progress=False)
    assert (tmp_path / "t" / "chunk-00000.npz").stat().st_mtime_ns == first
    assert np.array_equal(again.ids, cache.ids)
    tokens, teacher, hidden = again.batch(np.array([0, 3]))
    assert (
        tokens.shape == (2, 32) and teacher.ids.shape[:2] == (2, 32) and hidden.shape[:2] == (2, 32)
    )
