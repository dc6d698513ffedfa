"""What an "auto" policy learned is kept across processes, per target, drafter, sampling
settings and machine: a new process starts from it instead of from nothing."""

from __future__ import annotations

import os
import shutil

import mlx_spec
from mlx_spec.api import make_policy
from mlx_spec.core.sampling import SamplingConfig

from helpers import with_eos


def test_a_new_process_takes_up_what_the_last_learned(checkpoints, tmp_path, monkeypatch):
    monkeypatch.setenv("MLX_SPEC_POLICY_MEMORY", "1")
    monkeypatch.setenv("MLX_SPEC_CACHE", str(tmp_path))
    target_dir, draft_dir = checkpoints["llama"]
    model, tokenizer = mlx_spec.load(str(target_dir))
    drafter = mlx_spec.load_drafter(str(draft_dir))
    first = mlx_spec.generate(model, with_eos(tokenizer), "abc", drafter=drafter, max_tokens=40)
    (kept,) = list((tmp_path / "policies").glob("*.json"))
    # a new process: the target and the drafter loaded again, nothing in memory
    model, tokenizer = mlx_spec.load(str(target_dir))
    drafter = mlx_spec.load_drafter(str(draft_dir))
    policy = make_policy("auto", 8, drafter, model=model, sampling=SamplingConfig())
    assert policy.plain is not None and sum(policy.arms[0].trials) > 0
    again = mlx_spec.generate(model, with_eos(tokenizer), "abc", drafter=drafter, max_tokens=40)
    assert again.tokens == first.tokens
    # other sampling settings, another drafter: learned apart
    other = make_policy("auto", 8, drafter, model=model, sampling=SamplingConfig(temperature=1.0))
    assert other.plain is None
    assert (
        make_policy(
            "auto", 8, mlx_spec.NgramDrafter(), model=model, sampling=SamplingConfig()
        ).plain
        is None
    )
    assert list((tmp_path / "policies").glob("*.json")) == [kept]


def test_nothing_is_kept_when_turned_off(checkpoints, tmp_path, monkeypatch):
    monkeypatch.setenv("MLX_SPEC_POLICY_MEMORY", "0")
    monkeypatch.setenv("MLX_SPEC_CACHE", str(tmp_path))
    model, tokenizer = mlx_spec.load(str(checkpoints["llama"][0]))
    mlx_spec.generate(model, tokenizer, "abc", drafter="ngram", max_tokens=16)
    assert not (tmp_path / "policies").exists()


def test_a_drafter_trained_again_into_its_folder_starts_afresh(checkpoints, tmp_path, monkeypatch):
    """What was learned with weights since replaced in the same folder is not taken up."""
    monkeypatch.setenv("MLX_SPEC_POLICY_MEMORY", "1")
    monkeypatch.setenv("MLX_SPEC_CACHE", str(tmp_path / "cache"))
    target_dir, draft_dir = checkpoints["llama"]
    folder = shutil.copytree(draft_dir, tmp_path / "draft")
    model, tokenizer = mlx_spec.load(str(target_dir))
    drafter = mlx_spec.load_drafter(str(folder))
    mlx_spec.generate(model, with_eos(tokenizer), "abc", drafter=drafter, max_tokens=40)
    assert make_policy("auto", 8, drafter, model=model, sampling=SamplingConfig()).plain
    weights = next(folder.glob("*.safetensors"))
    os.utime(weights, ns=(weights.stat().st_atime_ns, weights.stat().st_mtime_ns + 10**9))
    drafter = mlx_spec.load_drafter(str(folder))
    assert make_policy("auto", 8, drafter, model=model, sampling=SamplingConfig()).plain is None
