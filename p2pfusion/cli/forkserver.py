"""CLI processes forked from one that has already imported what they need.

A `p2pfusion run-peer` process spends seconds of CPU importing torch, transformers and hivemind
before its first line of work (4 to 6 s of one core on this 2-core VM, the more the busier it is).
A local swarm of N peers pays that once through a fork server: a process that imports them and
then forks one child per command line. From there each child is what a fresh process would be:
its own arguments, environment, working directory, stdin, stdout, stderr, exit code and logging
(set up by the CLI in the child). Nothing is computed before a fork, so no child inherits a
half-started thread pool, and the server holds no threads.

Two things a fresh process settles before its imports are settled here once for all children:
OpenMP's spin time (`GOMP_SPINCOUNT`, which importing the package sets and torch reads as it
loads) and the quantization libraries transformers sees (none: each child imports its own
format's library itself).
"""

from __future__ import annotations

import importlib
import io
import json
import os
import runpy
import select
import signal
import socket
import subprocess
import sys
import threading
import time

from p2pfusion.cli.options import QUANTIZERS
from p2pfusion.errors import ConfigError

READY_TIMEOUT = 300.0  # the server's imports, on a machine busy with other peers
_MESSAGE = 1 << 16


class ForkedProcess:
    """What `subprocess.Popen` offers for a child of the fork server: its exit code arrives from
    the server, which is its parent."""

    def __init__(self, server: ForkServer, pid: int, args: list[str]):
        self.server, self.pid, self.args = server, pid, args
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            self.server.receive(0.0)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.returncode is None:
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                raise subprocess.TimeoutExpired(self.args, timeout)
            self.server.receive(left)
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:  # an exited child's pid may already be another process's
            os.kill(self.pid, sig)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


class ForkServer:
    """Starts the server process at once, so that its imports overlap the caller's work; the
    first `popen` waits for them. Children outlive `close`, as a Popen's would."""

    def __init__(self) -> None:
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self._server = subprocess.Popen(
            [sys.executable, "-m", "p2pfusion.cli.forkserver", str(theirs.fileno())],
            pass_fds=[theirs.fileno()], stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
        )
        theirs.close()
        self._sock = ours
        self._requests = threading.Lock()  # a request and its reply, one at a time
        self._messages = threading.Lock()
        self._asked: list[list[str]] = []  # command lines sent, not yet answered with a pid
        self._started: list[ForkedProcess] = []  # answered, not yet handed to the caller
        self._running: dict[int, ForkedProcess] = {}

    def popen(self, argv: list[str], *, stdin=None, stdout=None, stderr=None, env: dict | None = None,
              cwd: str | os.PathLike | None = None) -> ForkedProcess:
        """`p2pfusion ARGV` in a forked child; stdin/stdout/stderr: None (this process's),
        `subprocess.DEVNULL`, a file object or a file descriptor."""
        request = {"argv": list(argv), "env": dict(os.environ if env is None else env),
                   "cwd": str(cwd or os.getcwd())}
        with _streams(stdin, stdout, stderr) as fds, self._requests:
            with self._messages:
                self._asked.append(list(argv))
            socket.send_fds(self._sock, [json.dumps(request).encode()], fds)
            deadline = time.monotonic() + READY_TIMEOUT
            while not self._started:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise ConfigError(f"the fork server did not answer within {READY_TIMEOUT:.0f} s")
                self.receive(left)
            with self._messages:
                return self._started.pop(0)

    def receive(self, timeout: float | None) -> None:
        """Record what the server has said, waiting up to `timeout` for it to say something."""
        select.select([self._sock], [], [], timeout)
        with self._messages:
            while True:
                try:
                    raw = self._sock.recv(_MESSAGE, socket.MSG_DONTWAIT)
                except BlockingIOError:
                    return
                if not raw:
                    raise ConfigError(f"the fork server has exited (code {self._server.poll()})")
                message = json.loads(raw)
                if "pid" in message:
                    child = ForkedProcess(self, message["pid"], self._asked.pop(0))
                    self._running[child.pid] = child
                    self._started.append(child)
                else:  # the server sends a child's pid before its exit
                    self._running.pop(message["exit"]).returncode = message["code"]

    def close(self) -> None:
        self._sock.close()
        self._server.wait()


class _streams:
    """The three descriptors a child gets, opened for the request and closed after it."""

    def __init__(self, *streams):
        self.streams, self.opened = streams, []

    def __enter__(self) -> list[int]:
        fds = []
        for number, stream in enumerate(self.streams):
            if stream is None:
                fds.append(number)
            elif stream == subprocess.DEVNULL:
                self.opened.append(os.open(os.devnull, os.O_RDWR))
                fds.append(self.opened[-1])
            elif isinstance(stream, int):
                fds.append(stream)
            elif hasattr(stream, "fileno"):
                stream.flush()
                fds.append(stream.fileno())
            else:
                raise ValueError(f"a forked child takes None, DEVNULL, a file or a descriptor, not {stream!r}")
        return fds

    def __exit__(self, *exc) -> None:
        for fd in self.opened:
            os.close(fd)


def _serve(sock: socket.socket) -> None:
    for library in QUANTIZERS.values():
        sys.modules.setdefault(library, None)
    importlib.import_module("p2pfusion.cli.commands")  # what the commands import: torch, transformers, hivemind

    sys.stderr.flush()  # nothing of the server's is printed twice by its children
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    while True:
        readable = select.select([sock, wake_r], [], [])[0]
        if wake_r in readable:
            os.read(wake_r, 4096)
            _reap(sock)
        if sock in readable:
            raw, fds, _, _ = socket.recv_fds(sock, _MESSAGE, 3)
            if not raw:
                return  # the caller has gone; the children run on
            pid = os.fork()
            if pid == 0:
                sock.close()
                for fd in (wake_r, wake_w):
                    os.close(fd)
                _child(json.loads(raw), fds)
            for fd in fds:
                os.close(fd)
            sock.send(json.dumps({"pid": pid}).encode())


def _reap(sock: socket.socket) -> None:
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        sock.send(json.dumps({"exit": pid, "code": os.waitstatus_to_exitcode(status)}).encode())


def _child(request: dict, fds: list[int]) -> None:
    code = 1
    try:
        signal.set_wakeup_fd(-1)
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        for target, fd in enumerate(fds):
            os.dup2(fd, target)
            os.close(fd)
        os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update(request["env"])
        _fresh_stdio()
        for library in QUANTIZERS.values():
            if library in sys.modules and sys.modules[library] is None:
                del sys.modules[library]  # main() hides again the ones this command does not use
        sys.argv = ["p2pfusion", *request["argv"]]
        runpy.run_module("p2pfusion.cli.main", run_name="__main__", alter_sys=True)  # as `python -m` runs it
        code = 0
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    except BaseException:  # what the interpreter prints for an uncaught error, and its exit code
        sys.excepthook(*sys.exc_info())
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def _fresh_stdio() -> None:
    """stdout and stderr buffered as a fresh process's would be on the descriptors it was given."""
    unbuffered = bool(os.environ.get("PYTHONUNBUFFERED"))
    for number, name in ((1, "stdout"), (2, "stderr")):
        old = getattr(sys, name)
        raw = open(number, "wb", buffering=0 if unbuffered else -1, closefd=False)
        line_buffered = number == 2 or os.isatty(number)
        setattr(sys, name, io.TextIOWrapper(raw, encoding=old.encoding, errors=old.errors,
                                            line_buffering=line_buffered, write_through=unbuffered))


if __name__ == "__main__":
    _serve(socket.socket(fileno=int(sys.argv[1])))
