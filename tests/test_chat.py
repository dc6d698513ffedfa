"""`mlx-spec chat` as a real process: scripted on standard input and driven through a
pseudo-terminal; later turns reuse the prompt cache and Ctrl-C stops a reply, not the chat."""

from __future__ import annotations

import io
import json
import os
import pty
import re
import select
import shutil
import signal
import subprocess
import sys
import time
from unittest import mock

import pytest
from helpers import cli_here

STATS = re.compile(
    r"last reply: (\d+) tokens.*?prompt (\d+) tokens: (\d+) cached, (\d+) prefilled(.*)"
)
# A chat template over the test alphabet: "p " opens a user turn, "o " the assistant's, and an
# assistant turn ends with the EOS token.
TEMPLATE = (
    "{% for m in messages %}{% if m['role'] == 'assistant' %}o {{ m['content'] }}</s>\n"
    "{% else %}p {{ m['content'] }}\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}o {% endif %}"
)


def chat_command(model, *extra: str) -> list[str]:
    return [sys.executable, "-m", "mlx_spec.cli", "chat", "--model", str(model), *extra]


def run_chat(model, lines: list[str], *extra: str) -> subprocess.CompletedProcess:
    """`mlx-spec chat` in this process, `lines` piped to its standard input."""
    with mock.patch("sys.stdin", io.StringIO("".join(line + "\n" for line in lines))):
        return cli_here("chat", "--model", str(model), *extra)


def stats_lines(text: str) -> list[tuple[int, int, int, int, str]]:
    """(generated, prompt, cached, prefilled, rest) of every /stats line."""
    return [
        (int(g), int(p), int(c), int(f), rest)
        for g, p, c, f, rest in STATS.findall(text.replace("\r", ""))
    ]


@pytest.fixture(scope="module")
def templated(checkpoints, tmp_path_factory):
    """The llama target with a chat template in its tokenizer config."""
    path = shutil.copytree(checkpoints["llama"][0], tmp_path_factory.mktemp("chat") / "target")
    config = json.loads((path / "tokenizer_config.json").read_text())
    config["chat_template"] = TEMPLATE
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    return path


@pytest.fixture(scope="module")
def talkative(checkpoints, tmp_path_factory):
    """The llama target without an EOS token and with a 4096-token context: its replies run to
    --max-tokens (long enough to be interrupted)."""
    path = shutil.copytree(checkpoints["llama"][0], tmp_path_factory.mktemp("chat") / "long")
    for name, drop in (("config.json", "eos_token_id"), ("tokenizer_config.json", "eos_token")):
        config = json.loads((path / name).read_text())
        config.pop(drop)
        if name == "config.json":
            config["max_position_embeddings"] = 4096
        (path / name).write_text(json.dumps(config))
    return path


@pytest.mark.parametrize("drafter", ["none", "ngram", "draft-model"])
def test_scripted_turns_reuse_the_cache(checkpoints, loaded, drafter):
    """Without a chat template (plain transcript, said once): the second turn prefills only its
    new text (and the first reply's last token, still pending after speculative decoding)."""
    target, draft = checkpoints["llama"]
    extra = {"none": [], "ngram": ["--ngram"], "draft-model": ["--draft-model", str(draft)]}
    proc = run_chat(target, ["abc", "/stats", "mad pop", "/stats", "/quit", "ignored"],
                    "--max-tokens", "16", *extra[drafter])  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr.count("no chat template") == 1
    (g1, p1, c1, f1, _), (g2, p2, c2, f2, rest) = stats_lines(proc.stdout)
    tok = loaded["llama"][1]
    assert (g1, c1, f1) == (16, 0, p1) and p1 == len(tok.encode("User: abc\nAssistant:"))
    pending = 0 if drafter == "none" else 1
    new = tok.encode("\nUser: mad pop\nAssistant:", add_special_tokens=False)
    assert (c2, f2) == (p1 + 16 - pending, len(new) + pending)
    assert p2 == c2 + f2 and "rebuilt" not in rest
    if drafter != "none":
        assert "acceptance" in proc.stdout


def test_chat_template_and_commands(templated):
    """With a chat template: replies end at EOS or max_tokens, the next turn extends the cache;
    /reset forgets it; unknown commands are answered; end of input leaves with code 0."""
    lines = ["abc", "mad", "/stats", "/bogus", "/reset", "abc", "/stats", "/help"]
    proc = run_chat(templated, lines, "--ngram", "--max-tokens", "12", "--system", "hello")
    assert proc.returncode == 0, proc.stderr
    assert "no chat template" not in proc.stderr
    (g2, p2, c2, f2, rest), (g3, p3, c3, f3, _) = stats_lines(proc.stdout)
    assert c2 > 0 and f2 < p2 and "rebuilt" not in rest
    assert c3 == 0 and f3 == p3  # after /reset
    assert "unknown command /bogus" in proc.stdout and "/quit" in proc.stdout


@pytest.mark.parametrize("args", [["--top-p", "2"], ["--num-draft", "-1"], ["--max-tokens", "0"]])
def test_bad_settings_are_one_line_errors(checkpoints, args):
    proc = run_chat(checkpoints["llama"][0], ["abc"], "--ngram", *args)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert "mlx-spec: error:" in proc.stderr


def test_sigint_stops_the_reply_not_the_chat(talkative):
    """SIGINT during a long reply stops it after the chunk being shown; the chat goes on and
    the next turn still reuses the cache (the stopped reply is in the history as shown)."""
    proc = subprocess.Popen(
        chat_command(talkative, "--ngram", "--max-tokens", "1500"),
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    try:
        proc.stdin.write(b"abc\n")
        proc.stdin.flush()
        first = os.read(proc.stdout.fileno(), 1)  # the reply has started
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(b"/stats\nmad\n/stats\n", timeout=180)
    finally:
        proc.kill()
    text = (first + out).decode()
    assert proc.returncode == 0, err.decode()
    assert "[reply stopped]" in text
    (g1, p1, _, _, _), (g2, p2, c2, f2, rest) = stats_lines(text)
    assert 0 < g1 < 1500  # stopped early
    # the shown reply is reused (less a newline the stop matcher might still hold back)
    assert g2 > 0 and c2 >= p1 + g1 - 2 and "rebuilt" not in rest


class Terminal:
    """What the child wrote to the pseudo-terminal, read up to successive patterns (text read
    past a match stays for the next one)."""

    def __init__(self, fd: int):
        self.fd, self.text, self.pos = fd, "", 0

    def read_until(self, pattern: str, timeout: float = 120) -> None:
        deadline = time.monotonic() + timeout
        while (found := self.text.find(pattern, self.pos)) < 0:
            left = deadline - time.monotonic()
            if left <= 0:
                raise AssertionError(f"no {pattern!r} in terminal output: {self.text!r}")
            ready, _, _ = select.select([self.fd], [], [], left)
            if ready:
                try:
                    data = os.read(self.fd, 4096).decode(errors="replace")
                except OSError:  # the child closed the terminal
                    data = ""
                if not data:
                    raise AssertionError(f"terminal closed before {pattern!r}: {self.text!r}")
                self.text += data
        self.pos = found + len(pattern)

    def read_some(self, timeout: float = 120) -> None:
        """Wait until something beyond the last match has been written."""
        deadline = time.monotonic() + timeout
        while len(self.text) <= self.pos and time.monotonic() < deadline:
            ready, _, _ = select.select([self.fd], [], [], deadline - time.monotonic())
            if ready:
                self.text += os.read(self.fd, 4096).decode(errors="replace")


def test_ctrl_c_through_a_terminal(talkative):
    """Through a pseudo-terminal (prompt, line editing): Ctrl-C typed during a reply stops it
    and the prompt comes back; the next reply, stopped too, reused the cache (/stats); Ctrl-D
    leaves."""
    pid, fd = pty.fork()
    if pid == 0:  # the child: the chat, with the terminal as its controlling terminal
        os.execv(sys.executable, chat_command(talkative, "--ngram", "--max-tokens", "1500"))
    term = Terminal(fd)
    status = None
    try:
        term.read_until(">>> ")
        for line in (b"abc", b"mad"):
            os.write(fd, line + b"\n")
            term.read_until(line.decode() + "\r\n")  # the echo
            term.read_some()  # the reply has started
            os.write(fd, b"\x03")  # Ctrl-C
            term.read_until("[reply stopped]")
            term.read_until(">>> ")
        os.write(fd, b"/stats\n")
        term.read_until("prefilled")
        term.read_until(">>> ")
        os.write(fd, b"\x04")  # Ctrl-D
        _, status = os.waitpid(pid, 0)
    finally:
        if status is None:  # still ours and not reaped: stop it
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
        os.close(fd)
    assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0, term.text
    ((_, p, cached, prefilled, rest),) = stats_lines(term.text)
    assert cached > 0 and prefilled < p and "rebuilt" not in rest
