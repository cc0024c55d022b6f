"""``kvferry chat`` driven through a pseudo-terminal, as a user's terminal
drives it: ``os.forkpty`` makes the pty the child's controlling terminal,
so ``\\x03`` typed into it is a real SIGINT from the line discipline and
``\\x04`` a real end of file. The child imports the tests' PYTHONPATH."""
from __future__ import annotations

import codecs
import fcntl
import os
import re
import select
import signal
import struct
import sys
import termios
import time

# Escape sequences a line editor may write (cursor moves, modes); stripped
# before matching, with the terminal's carriage returns.
_ESCAPES = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]|\x1b[=>]|\r")


class PtyChat:
    def __init__(self, args: list[str], env: dict[str, str] | None = None) -> None:
        env = dict(os.environ if env is None else env, TERM="dumb", PYTHONUNBUFFERED="1")
        argv = [sys.executable, "-m", "kvferry.cli", "chat", *args]
        pid, fd = os.forkpty()
        if pid == 0:  # the child: exec at once (nothing else runs after a fork)
            try:
                fcntl.ioctl(0, termios.TIOCSWINSZ, struct.pack("HHHH", 50, 250, 0, 0))
                os.execve(sys.executable, argv, env)
            finally:
                os._exit(127)
        self.pid, self.fd = pid, fd
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._raw = ""
        self.pos = 0  # how much of text() the expects consumed
        self.returncode: int | None = None

    def text(self) -> str:
        return _ESCAPES.sub("", self._raw)

    def _read(self, timeout_s: float) -> bool:
        """Read what is there within ``timeout_s``; False at end of output."""
        ready, _, _ = select.select([self.fd], [], [], timeout_s)
        if not ready:
            return True
        try:
            data = os.read(self.fd, 65536)
        except OSError:  # EIO: the child closed the terminal
            return False
        self._raw += self._decoder.decode(data)
        return bool(data)

    def expect(self, pattern: str, timeout_s: float = 120.0) -> re.Match:
        """The first match of ``pattern`` after what earlier expects consumed."""
        deadline = time.monotonic() + timeout_s
        while True:
            m = re.compile(pattern).search(self.text(), self.pos)
            if m:
                self.pos = m.end()
                return m
            if time.monotonic() > deadline or not self._read(min(0.5, max(0.0, deadline - time.monotonic()))):
                m = re.compile(pattern).search(self.text(), self.pos)
                if m:
                    self.pos = m.end()
                    return m
                raise AssertionError(f"no {pattern!r} in the chat's output:\n{self.text()[-4000:]}")

    def send(self, text: str) -> None:
        os.write(self.fd, text.encode())

    def line(self, text: str) -> None:
        self.send(text + "\r")  # Enter, as a terminal sends it

    def wait(self, timeout_s: float = 60.0) -> int:
        """The exit code (draining the output meanwhile, so the child never
        blocks on a full terminal)."""
        deadline = time.monotonic() + timeout_s
        while self.returncode is None:
            pid, status = os.waitpid(self.pid, os.WNOHANG)
            if pid:
                self.returncode = os.waitstatus_to_exitcode(status)
                break
            if time.monotonic() > deadline:
                raise AssertionError(f"the chat did not exit in {timeout_s} s:\n{self.text()[-4000:]}")
            self._read(0.1)
        while self._read(0.05):
            pass
        return self.returncode

    def close(self) -> None:
        if self.returncode is None:  # unreaped, so the pid is still the child's
            os.kill(self.pid, signal.SIGTERM)  # the chat stops a server it started on SIGTERM
            try:
                self.wait(60)
            except AssertionError:
                os.kill(self.pid, signal.SIGKILL)
                os.waitpid(self.pid, 0)
        os.close(self.fd)
