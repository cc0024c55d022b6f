"""The conversation loop of ``kvferry chat``, as ``ollama run``'s:

    >>> a message            the answer streams in as it is generated
    >>> \"\"\"                  several lines, up to a line that ends with \"\"\"
    >>> /help                the commands

The whole history goes with each message (the server keeps no session).
A Ctrl-C while an answer streams stops it: the connection closes, the
server aborts the request, and the unfinished exchange is left out of the
history. A Ctrl-C or Ctrl-D at the prompt ends the chat.
"""
from __future__ import annotations

import sys
from collections.abc import Callable
from typing import TextIO

from kvferry.chat.client import Answer, ChatClient, ChatError

# A model's text may hold control characters (a random or broken model's
# often does): ESC would let it move the cursor or retitle the terminal,
# CR overwrite what was shown. They are shown as U+FFFD; the history keeps
# the text as it came.
_CONTROLS = {c: "\ufffd" for c in [*range(0x00, 0x20), *range(0x7f, 0xa0)] if chr(c) not in "\n\t"}

PROMPT = ">>> "
CONTINUATION = "... "
MULTILINE = '"""'

HELP = """\
Commands:
  /clear          forget the conversation (the system prompt stays)
  /system TEXT    set the system prompt (/system alone shows it)
  /verbose        show or hide each answer's token counts and speed
  /help           this list
  /exit, /bye     leave (Ctrl-D too)
A message that starts with \"\"\" goes on over several lines, up to a line that ends with \"\"\".
Ctrl-C stops an answer while it streams; at the prompt it leaves."""


class ChatSession:
    """The history and the loop. ``read`` is ``input`` (readline's line
    editing where the terminal has it); ``out`` is where answers go."""

    def __init__(self, client: ChatClient, model: str, *, system: str | None = None,
                 options: dict | None = None, verbose: bool = False,
                 read: Callable[[str], str] = input, out: TextIO = sys.stdout) -> None:
        self.client = client
        self.model = model
        self.system = system
        self.options = dict(options or {})
        self.verbose = verbose
        self.history: list[dict] = []  # user and assistant turns, without the system prompt
        self._read = read
        self._out = out

    def messages(self) -> list[dict]:
        system = [{"role": "system", "content": self.system}] if self.system else []
        return system + self.history

    def run(self) -> int:
        """Read and answer until /exit, Ctrl-D or Ctrl-C at the prompt; 0."""
        while True:
            try:
                text = self._read_message()
            except (EOFError, KeyboardInterrupt):
                self._print("")
                return 0
            if text is None:
                return 0
            if text.strip():
                self.ask(text)

    def _read_message(self) -> str | None:
        """The next message; a command is handled here and gives "" (None: leave)."""
        line = self._read(PROMPT)
        stripped = line.strip()
        if stripped.startswith(MULTILINE):
            return self._read_multiline(stripped[len(MULTILINE):])
        if stripped.startswith("/"):
            return self.command(stripped)
        return line

    def _read_multiline(self, first: str) -> str:
        lines = [first]
        while not lines[-1].rstrip().endswith(MULTILINE):
            lines.append(self._read(CONTINUATION))
        lines[-1] = lines[-1].rstrip().removesuffix(MULTILINE)
        return "\n".join(lines).strip("\n")

    def command(self, line: str) -> str | None:
        """Handle a /command: "" to go on, None to leave."""
        name, _, arg = line.partition(" ")
        arg = arg.strip()
        if name in ("/exit", "/bye", "/quit"):
            return None
        if name == "/clear":
            self.history.clear()
            self._print("Cleared the conversation." + (" The system prompt stays." if self.system else ""))
        elif name == "/system":
            if arg:
                self.system = arg
                self._print("Set the system prompt.")
            else:
                self._print(f"System prompt: {self.system}" if self.system else "No system prompt (/system TEXT).")
        elif name == "/verbose":
            self.verbose = not self.verbose
            self._print(f"Verbose {'on' if self.verbose else 'off'}.")
        elif name in ("/help", "/?"):
            self._print(HELP)
        else:
            self._print(f"Unknown command {name}; /help lists them.")
        return ""

    def ask(self, text: str) -> Answer | None:
        """Send ``text`` with the history and stream the answer; it joins
        the history when it completes (None: stopped or failed)."""
        self.history.append({"role": "user", "content": text})
        answer = Answer()
        pieces = self.client.stream(self.model, self.messages(), self.options, answer)
        try:
            for piece in pieces:
                self._out.write(printable(piece))
                self._out.flush()
        except KeyboardInterrupt:
            pieces.close()  # closes the connection now: the server aborts the request
            self.history.pop()
            self._print("\n[stopped]")
            return None
        except ChatError as exc:
            self.history.pop()
            self._print(("\n" if answer.text else "") + f"error: {exc}")
            return None
        finally:
            pieces.close()
        self.history.append({"role": "assistant", "content": answer.text})
        self._print("\n" if answer.text.endswith("\n") else "\n\n", end="")
        if self.verbose:
            self._print(stats_line(answer))
        return answer

    def _print(self, text: str, end: str = "\n") -> None:
        self._out.write(text + end)
        self._out.flush()


def printable(text: str) -> str:
    """``text`` with control characters other than newline and tab replaced."""
    return text.translate(_CONTROLS)


def stats_line(answer: Answer) -> str:
    """``prompt tokens 31, answer tokens 16 (length), first token 0.08 s, 212.4 tokens/s``:
    the counts are the server's (its usage), the times the client's."""
    parts = [f"prompt tokens {answer.prompt_tokens}",
             f"answer tokens {answer.completion_tokens} ({answer.finish_reason})"]
    if answer.first_token_at is not None and answer.ended_at is not None:
        parts.append(f"first token {answer.first_token_at - answer.started:.2f} s")
        decode_s = answer.ended_at - answer.first_token_at
        if answer.completion_tokens and answer.completion_tokens > 1 and decode_s > 0:
            parts.append(f"{(answer.completion_tokens - 1) / decode_s:.1f} tokens/s")
    return ", ".join(parts)
