"""The `mlx-spec` command line, run as a real subprocess: JSON output, info, help, errors."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest
from helpers import cli_here

STATS_KEYS = {"acceptance_rate", "mean_accepted_length", "target_passes", "decode_tokens_per_sec"}


def run_cli(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    """Run `python -m mlx_spec.cli ARGS`; returns the completed process (text output)."""
    return subprocess.run(
        [sys.executable, "-m", "mlx_spec.cli", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def error_lines(stderr: str) -> list[str]:
    """stderr lines other than mlx-spec's own warnings (e.g. the slow-BLAS one)."""
    return [line for line in stderr.splitlines() if not line.startswith("mlx-spec: warning:")]


def generate_json(target, *extra: str, run=cli_here) -> dict:
    """`generate --json` on the target (in this process, or by `run`); asserts one JSON object
    on stdout and returns it."""
    proc = run(
        "generate", "--model", str(target), "--prompt", "abcab", "--max-tokens", "16",
        "--json", *extra,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    lines = [line for line in proc.stdout.splitlines() if line.strip()]
    assert len(lines) == 1, proc.stdout
    return json.loads(lines[0])


@pytest.fixture(scope="module")
def plain_record(checkpoints):
    return generate_json(checkpoints["llama"][0], run=run_cli)  # the installed entry, once


@pytest.mark.parametrize("mode", ["plain", "ngram", "draft-model"])
def test_generate_json(checkpoints, plain_record, mode):
    """`generate --json` prints one JSON object (text, tokens, stats) and, at temperature 0,
    speculative runs print the plain run's tokens and text."""
    target, draft = checkpoints["llama"]
    extra = {"plain": (), "ngram": ("--ngram",), "draft-model": ("--draft-model", str(draft))}
    record = plain_record if mode == "plain" else generate_json(target, *extra[mode])
    assert {"text", "tokens", "stats"} <= set(record)
    assert STATS_KEYS <= set(record["stats"])
    assert record["tokens"] and all(isinstance(t, int) for t in record["tokens"])
    assert record["stats"]["generated_tokens"] == len(record["tokens"])
    assert record["tokens"] == plain_record["tokens"]
    assert record["text"] == plain_record["text"]
    expected = {"plain": "none", "ngram": "ngram", "draft-model": "draft-model"}[mode]
    assert record["stats"]["drafter"] == expected


def test_info_names_blas():
    """`info` exits 0 and prints a line naming the BLAS."""
    proc = run_cli("info")
    assert proc.returncode == 0, proc.stderr
    assert any(line.startswith("blas") for line in proc.stdout.splitlines()), proc.stdout


@pytest.mark.parametrize("args", [["--help"], ["generate", "--help"]], ids=" ".join)
def test_help_exits_zero(args):
    """`--help` and `generate --help` print usage and exit 0."""
    proc = run_cli(*args)
    assert proc.returncode == 0, proc.stderr
    assert "usage:" in proc.stdout


def bad_config_dir(root, model_dir):
    """A copy of `model_dir` whose config.json lacks the architecture's required fields."""
    path = shutil.copytree(model_dir, root / "bad-config")
    (path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    return path


@pytest.mark.parametrize(
    "case", ["missing-model", "num-draft", "top-p", "empty-prompt", "bad-config"]
)
def test_errors_are_one_line(checkpoints, tmp_path, case):
    """Bad input exits with code 2 and one `mlx-spec: error:` line, never a traceback."""
    target = str(checkpoints["llama"][0])
    args = {
        "missing-model": ["--model", str(tmp_path / "missing"), "--prompt", "ab"],
        "num-draft": ["--model", target, "--prompt", "ab", "--num-draft", "-1"],
        "top-p": ["--model", target, "--prompt", "ab", "--top-p", "2"],
        "empty-prompt": ["--model", target, "--prompt", ""],
        "bad-config": ["--model", str(bad_config_dir(tmp_path, target)), "--prompt", "ab"],
    }[case]
    proc = cli_here("generate", *args)
    assert "Traceback" not in proc.stderr + proc.stdout, proc.stderr
    assert proc.returncode == 2, proc.stderr
    lines = error_lines(proc.stderr)
    assert len(lines) == 1 and lines[0].startswith("mlx-spec: error:"), proc.stderr
