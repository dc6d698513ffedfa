"""`mlx-spec chat`: a streaming conversation with a target and its drafter, whose caches carry
over from turn to turn (see `session.py`)."""

from __future__ import annotations

import signal
import sys
import threading
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from typing import TextIO

from mlx_spec.core.sampling import SamplingConfig
from mlx_spec.core.stats import SpecStats
from mlx_spec.serving.session import Session

FALLBACK_STOP = "\nUser:"

HELP = """commands:
  /stats   acceptance, speed and prompt-cache use of the last reply
  /reset   forget the conversation (and the cached tokens)
  /help    this list
  /quit    leave (so does end of input)
Ctrl-C stops a reply; the conversation goes on with what was shown."""


def has_chat_template(tokenizer) -> bool:
    """Whether the tokenizer ships a chat template."""
    return bool(getattr(tokenizer, "has_chat_template", False))


def fallback_prompt(messages: list[dict]) -> str:
    """A plain "User:/Assistant:" transcript ending with "Assistant:", for tokenizers without a
    chat template. A reply is rendered right after "Assistant:", exactly as it was generated,
    so the next turn's prompt extends the cached tokens."""
    parts = []
    for message in messages:
        role, content = message["role"], message["content"]
        if role in ("system", "developer"):
            parts.append(f"{content}\n\n")
        elif role == "assistant":
            parts.append(f"Assistant:{content}\n")
        else:
            parts.append(f"User: {content}\n")
    return "".join(parts) + "Assistant:"


def chat_prompt(tokenizer, messages: list[dict], tools: list[dict] | None = None) -> str:
    """The prompt text for `messages` (dicts with role and content), ready for the assistant's
    reply: the tokenizer's chat template if it has one, else `fallback_prompt`. `tools`
    (OpenAI function definitions) go to the template, which needs one."""
    if has_chat_template(tokenizer):
        extra = {"tools": tools} if tools else {}
        return tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=True, **extra
        )
    if tools:
        raise ValueError("tools need a chat template")
    return fallback_prompt(messages)


def stats_line(stats: SpecStats | None) -> str:
    """One line on the last reply: speed, acceptance and how much of its prompt was cached."""
    if stats is None:
        return "no reply yet"
    line = (
        f"last reply: {stats.generated_tokens} tokens, {stats.decode_tokens_per_sec:.1f} tokens/s"
    )
    if stats.drafter != "none":
        line += (
            f"; drafter {stats.drafter} k={stats.num_draft}: acceptance "
            f"{stats.acceptance_rate:.2f}, mean accepted length {stats.mean_accepted_length:.2f}"
        )
        if stats.num_draft == "auto":
            line += f" ({stats.choices_line()})"
    line += (
        f"; prompt {stats.prompt_tokens} tokens: {stats.cached_tokens} cached, "
        f"{stats.prefilled_tokens} prefilled"
    )
    return line + (" (cache rebuilt)" if stats.cache_reset else "")


@contextmanager
def stop_on_sigint() -> Iterator[dict]:
    """While active, Ctrl-C sets `flag["hit"]` instead of raising, so a reply can stop between
    two chunks with its caches settled; a second Ctrl-C raises KeyboardInterrupt."""
    flag = {"hit": False}
    if threading.current_thread() is not threading.main_thread():
        yield flag
        return

    def handler(signum, frame):
        if flag["hit"]:
            raise KeyboardInterrupt
        flag["hit"] = True

    previous = signal.signal(signal.SIGINT, handler)
    try:
        yield flag
    finally:
        signal.signal(signal.SIGINT, previous)


class Chat:
    """The read-reply loop over a `Session`.

    Args:
        session: the target and drafter.
        system: optional system prompt.
        max_tokens: tokens per reply at most.
        sampling: `temperature`, `top_p`, `top_k`, `min_p`, `seed` for `Session.stream`.
        out, err: where replies and notices go (default: standard output and error).
    """

    def __init__(
        self,
        session: Session,
        *,
        system: str | None = None,
        max_tokens: int = 512,
        sampling: dict | None = None,
        out: TextIO | None = None,
        err: TextIO | None = None,
    ):
        self.session = session
        self.system = system
        self.max_tokens = max_tokens
        self.sampling = dict(sampling or {})
        self.out, self.err = out or sys.stdout, err or sys.stderr  # read now, not at import
        self.templated = has_chat_template(session.tokenizer)
        self.stop = () if self.templated else (FALLBACK_STOP,)
        self.messages: list[dict] = []
        self.reset()

    def check_settings(self) -> None:
        """ValueError for sampling settings or a token limit that no reply could use."""
        keys = ("temperature", "top_k", "top_p", "min_p")
        SamplingConfig(**{k: v for k, v in self.sampling.items() if k in keys})
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be an integer >= 1, got {self.max_tokens}")

    def reset(self) -> None:
        self.messages = [{"role": "system", "content": self.system}] if self.system else []
        self.session.reset()
        self.session.last_stats = None

    def run(self, lines: Iterable[str]) -> int:
        """Answer each line of input (commands start with "/"); returns the exit code."""
        if not self.templated:
            print(
                "mlx-spec: note: the tokenizer has no chat template; using a plain "
                '"User: ... / Assistant: ..." transcript',
                file=self.err,
            )
        for line in lines:
            line = line.rstrip("\r\n")
            if not line.strip():
                continue
            if line.startswith("/"):
                if not self.command(line.strip()):
                    return 0
            else:
                self.reply(line)
        return 0

    def command(self, line: str) -> bool:
        """Run a command; False means leave."""
        name = line.split()[0].lower()
        if name in ("/quit", "/exit"):
            return False
        if name == "/stats":
            self._say(stats_line(self.session.last_stats))
        elif name == "/reset":
            self.reset()
            self._say("conversation reset")
        elif name == "/help":
            self._say(HELP)
        else:
            self._say(f"unknown command {name}; /help lists the commands")
        return True

    def reply(self, text: str) -> None:
        """Stream the assistant's reply to `text`; Ctrl-C stops it, keeping what was shown."""
        self.messages.append({"role": "user", "content": text})
        prompt = chat_prompt(self.session.tokenizer, self.messages)
        pieces, stopped = [], False
        with stop_on_sigint() as sigint:
            stream = self.session.stream(
                prompt, max_tokens=self.max_tokens, stop=self.stop, **self.sampling
            )
            try:
                for chunk in stream:
                    pieces.append(chunk.text)
                    self.out.write(chunk.text)
                    self.out.flush()
                    if sigint["hit"]:
                        stopped = True
                        break
            except KeyboardInterrupt:
                stopped = True
            except ValueError as exc:  # e.g. the conversation outgrew the context
                self.messages.pop()
                print(f"mlx-spec: error: {exc}", file=self.err)
                return
            finally:
                stream.close()
        self.messages.append({"role": "assistant", "content": "".join(pieces)})
        self._say("\n[reply stopped]" if stopped else "")

    def _say(self, text: str) -> None:
        print(text, file=self.out, flush=True)


def input_lines(stream: TextIO, prompt: str = ">>> ") -> Iterator[str]:
    """Lines typed at a terminal (with line editing and a prompt), or read from a pipe."""
    if not stream.isatty():
        yield from stream
        return
    while True:
        try:
            yield input(prompt)
        except EOFError:
            print()
            return
        except KeyboardInterrupt:
            print("\n(/quit or Ctrl-D leaves)")
