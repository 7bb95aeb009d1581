"""The assert-test harness, run in the sandbox as ``main.py``: verdicts the program cannot forge.

One sandbox run holds two processes (stdlib only; no ``json`` or ``re`` import, for start-up time):

- the **checker** (this file, as the sandbox's program) makes itself non-dumpable (a process of
  the same uid can then neither ptrace it, read or write its memory, nor open its ``/proc`` fds),
  starts the candidate, reads the job (program, tests, time limit) from stdin and runs each test's
  code in a namespace of its own. The program's top-level names are bound there to *handles*:
  calling one, or reading an attribute of one, is a request to the candidate, and what comes back
  is plain data (None, bool, int, float, complex, str, bytes, bytearray, list, tuple, dict, set,
  frozenset; an iterator as its items; what ``tolist()`` gives for NumPy values) rebuilt as fresh
  built-in objects, or a new handle. A handle can only be called or have attributes read:
  comparing, truth-testing, iterating or indexing one raises TypeError. So ``assert add(1, 2) == 3``
  compares real built-in values with real built-in operators, in a process the program never ran
  in; the checker writes one JSON line per test to its stdout, which only it holds.
- the **candidate** (this file again, started with ``-c`` and the argument ``candidate``) loads
  the program as module ``solution`` and answers requests on fds 3 (in) and 4 (out). Its stdin is
  ``/dev/null``; stdout and stderr are unlinked files the checker reads back at the end.

What the program can still decide: its own answers (return values and exceptions; of its
exceptions only common built-in ones reach the test as themselves, so a StopIteration cannot cut
a test's loop short), and the failure of any test (exit, hang, kill the checker). Names that
shadow builtins are not bound (a program's ``all`` would decide ``assert all(...)``). A test that
feeds the program's output to the program's own helper (HumanEval/32's ``poly``), or uses a module
it never imports itself, trusts the program there. A test whose call times out, exits or breaks
the protocol fails, and the candidate is restarted (the program loaded again) for the next test.
Under ``rlimits`` isolation without a uid of its own (a non-root host, see ``Sandbox.separate_uid``)
the program runs as the host's user and can reach the host's processes, which no harness inside
can prevent: there only namespaces make the verdict unforgeable.
"""

from __future__ import annotations

import builtins
import os
import signal
import sys
import time

if __name__ != "__main__":  # in the sandbox this file follows _wire.py's source in main.py
    from collections.abc import Callable
    from typing import Any

    from agentrl.verifiers._wire import CLIP, Reader, build, describe, dump, esc, loads, send, where

_MAX_GLOBAL = 10_000
"""Longer containers and strings among the program's globals stay handles (not copied at load)."""
_RERAISE = frozenset(
    "ArithmeticError AssertionError AttributeError Exception IndexError KeyError LookupError "
    "MemoryError NameError NotImplementedError OverflowError RecursionError RuntimeError "
    "TypeError UnboundLocalError UnicodeError ValueError ZeroDivisionError".split()
)
"""Exceptions of the program that reach the test as themselves; others come as ProgramError."""
_MODULES = frozenset(
    "array bisect calendar cmath collections copy dataclasses datetime decimal enum fractions "
    "functools hashlib heapq itertools json math numbers operator random re statistics string "
    "textwrap typing unicodedata".split()
)
"""Modules the program imported that tests get too (the real ones, imported by the checker)."""
_report = 1
"""The checker's report fd: a copy of its stdout, which itself then points to /dev/null."""


class ProgramError(Exception):
    """The program raised an exception that is not re-raised as itself (StopIteration, its own)."""


class ProgramGone(BaseException):
    """The program ended, exited, or broke the protocol.

    Not an Exception: no ``except Exception`` in a test catches it, so the program's death
    never passes a test that expects an error.
    """


class _Timeout(BaseException):
    pass


# ----------------------------------------------------------------------------- candidate

_PLAIN = (type(None), bool, int, float, complex, str, bytes, bytearray, list, tuple, dict, set,
          frozenset)


def _candidate() -> None:
    """Serve the checker's requests on fds 3 and 4 until it closes fd 3."""
    import _sitebuiltins

    shared: Any = builtins  # what site would have added (the sandbox runs python -S)
    shared.exit = _sitebuiltins.Quitter("exit", "Ctrl-D (i.e. EOF)")
    shared.quit = _sitebuiltins.Quitter("quit", "Ctrl-D (i.e. EOF)")
    reader, exit_, table, lines = Reader(3), os._exit, list[object](), list[str]()
    module: Any = type(sys)("solution")
    module.__file__, module.__builtins__ = "solution.py", builtins
    sys.modules["solution"], sys.argv[:] = module, ["solution.py"]

    def ref(x: object) -> str:  # not plain data: it stays here, the checker gets its number
        table.append(x)
        return f'{{"h":[{len(table) - 1},{esc(type(x).__name__[:60])}]}}'

    def deref(a: Any) -> object:
        if type(a) is list and a and type(a[0]) is int and 0 <= a[0] < len(table):
            return table[a[0]]
        raise ValueError("an unknown handle")

    while True:
        try:
            request: Any = build(loads(reader.frame()), deref)
        except EOFError:  # the checker is done
            exit_(0)
        try:
            if request[0] == "load":
                if request[2]:
                    import site

                    site.main()
                lines = request[1].splitlines()
                exec(compile(request[1], "solution.py", "exec"), module.__dict__)
                names = ",".join(_global(n, v, ref) for n, v in list(module.__dict__.items()))
                reply = f'["ok",[{names}]]'
            elif request[0] == "call":
                args = request[2]
                value = request[1](*args, **request[3])
                changed = [[i, a] for i, a in enumerate(args) if type(a) in (list, dict, set)]
                reply = f'["ok",{dump(value, ref)},{dump(changed, ref)}]'
            else:  # "get"
                reply = f'["ok",{dump(getattr(request[1], request[2]), ref)}]'
        except BaseException as e:
            at = where(e.__traceback__, "solution.py", lines)
            reply = f'["err",{esc(type(e).__name__[:60])},{esc(describe(e))},{esc(at)}]'
        for stream in (sys.stdout, sys.stderr):  # what was printed is in the files now
            try:
                stream.flush()
            except BaseException:
                pass
        send(4, reply)


def _global(name: str, value: object, ref: Callable[[object], str]) -> str:
    """One top-level name of the program, for the load reply: a module's name or a value."""
    if name.startswith("__"):
        return "null"
    if isinstance(value, type(sys)):
        return f'[{esc(name)},"m",{esc(str(value.__name__))}]'
    text = ""
    if isinstance(value, _PLAIN):  # a copy, unless large; anything else stays a handle
        try:
            sized = isinstance(value, (str, bytes, bytearray, list, tuple, dict, set, frozenset))
            small = not sized or len(value) <= _MAX_GLOBAL  # type: ignore[arg-type]
            text = dump(value, ref) if small else ""
        except Exception:
            text = ""
    return f'[{esc(name)},"v",{text or ref(value)}]'


# ----------------------------------------------------------------------------- checker


class _Program:
    """The candidate process, seen from the checker: started, asked, stopped, restarted."""

    def __init__(self, src: str, out_fd: int, err_fd: int) -> None:
        self.src, self.out_fd, self.err_fd = src, out_fd, err_fd
        self.gen, self.pid, self.w, self.reader = 0, 0, -1, Reader(-1)
        self.code, self.site, self.loaded = "", False, False
        self.names: dict[str, object] = {}
        """What the last load bound in the tests' namespace."""

    def start(self, fresh: bool = False) -> None:
        """Start a candidate: a fork of this process, or (not ``fresh``) this file run anew.

        ``fresh`` only before the job is read: the fork then holds nothing secret, and saves
        booting and compiling a second interpreter.
        """
        import fcntl

        req_r, req_w = os.pipe()
        rep_r, rep_w = os.pipe()
        top = os.sysconf("SC_OPEN_MAX")
        pid = os.fork()
        if pid == 0:  # the child keeps fds 0-4 only
            try:
                a, b = (fcntl.fcntl(fd, fcntl.F_DUPFD, 5) for fd in (req_r, rep_w))
                os.dup2(os.open(os.devnull, os.O_RDONLY), 0)
                os.dup2(self.out_fd, 1)
                os.dup2(self.err_fd, 2)
                os.dup2(a, 3)
                os.dup2(b, 4)
                os.closerange(5, max(top, 5))
                if fresh:
                    _candidate()
                argv = [sys.executable, "-I", "-S", "-B", "-c", self.src, "candidate"]
                os.execv(sys.executable, argv)
            finally:
                os._exit(127)
        os.close(req_r)
        os.close(rep_w)
        self.pid, self.w, self.reader, self.gen = pid, req_w, Reader(rep_r), self.gen + 1

    def stop(self) -> str:
        """End the candidate; how it ended, in words (its output is flushed before each reply)."""
        if not self.pid:
            return "it had ended"
        pid, self.pid, self.loaded = self.pid, 0, False
        os.close(self.w)
        done = os.waitpid(pid, os.WNOHANG)
        if done[0] == 0:
            os.kill(pid, signal.SIGKILL)
            done = os.waitpid(pid, 0)
        os.close(self.reader.fd)
        code = os.waitstatus_to_exitcode(done[1])
        return f"exit code {code}" if code >= 0 else f"killed by signal {-code}"

    def ask(self, request: list[object]) -> list[Any]:
        """Send a request; the ``["ok", ...]`` reply, or the program's exception raised here.

        The candidate is stopped on anything else: it ended, timed out or broke the protocol.
        """
        if not self.pid:
            raise ProgramGone("the program is not running")
        who = "it" if request[0] == "load" else "the program"  # a load's detail says who already
        text = dump(request, self._ref)  # the test's values: its error, the candidate untouched
        try:
            send(self.w, text)
            reply: Any = build(loads(self.reader.frame()), self._handle)
        except (EOFError, BrokenPipeError):
            when = "" if request[0] == "load" else " during the test"
            raise ProgramGone(f"{who} ended{when} ({self.stop()})") from None
        except Exception as e:  # malformed, too large, too deep
            self.stop()
            raise ProgramGone(f"{who} broke the test protocol: {describe(e)}") from None
        except BaseException:  # the time limit: the candidate is somewhere in the request
            self.stop()
            raise
        if type(reply) is list and len(reply) >= 2 and reply[0] == "ok":
            return reply
        if (
            type(reply) is list
            and len(reply) == 4
            and reply[0] == "err"
            and all(type(s) is str for s in reply[1:])
        ):
            name, text, where = reply[1][:60], reply[2][:CLIP], reply[3][:CLIP]
            kind = vars(builtins).get(name)
            if name in _RERAISE and isinstance(kind, type) and issubclass(kind, BaseException):
                raise kind(text[len(name) + 2 :] if text.startswith(name + ": ") else "")
            if name in ("SystemExit", "KeyboardInterrupt", "GeneratorExit"):
                raise ProgramGone(f"{text}{where}")  # uncaught by `except Exception`, as ever
            raise ProgramError(f"{text}{where}")
        self.stop()
        raise ProgramGone(f"{who} broke the test protocol: a malformed reply")

    def load(self, env: dict[str, object]) -> None:
        """Load the program in the candidate; bind its names in ``env`` (never over builtins)."""
        if not self.pid:
            self.start()
        names = self.ask(["load", self.code, self.site])[1]
        for old, value in self.names.items():  # a restart: the previous load's handles are dead
            if env.get(old) is value:
                del env[old]
        self.names, self.loaded = {}, True
        for item in names if type(names) is list else ():
            if type(item) is not list or len(item) != 3 or type(item[0]) is not str:
                continue
            name, kind, value = item
            if name.startswith("__") or name in vars(builtins):
                continue
            if kind == "m":  # a module the program imported: the test gets the real one
                if type(value) is not str or name not in (value, value.rsplit(".", 1)[-1]):
                    continue
                if value not in _MODULES:
                    continue
                try:
                    __import__(value)
                    value = sys.modules[value]
                except Exception:
                    continue
            env[name] = self.names[name] = value

    def _ref(self, x: object) -> str:
        if isinstance(x, _Handle) and x._gen == self.gen:
            return f'{{"h":[{x._id}]}}'
        if isinstance(x, _Handle):
            raise ProgramGone("an object of an earlier run of the program (it was restarted)")
        raise TypeError(
            f"cannot pass a {type(x).__name__} to the program: only plain values "
            "and the program's own objects"
        )

    def _handle(self, a: Any) -> _Handle:
        if type(a) is list and len(a) == 2 and type(a[0]) is int and type(a[1]) is str:
            return _Handle(self.gen, a[0], a[1][:60])
        raise ValueError("a malformed handle")


_program = _Program("", -1, -1)


class _Handle:
    """An object of the program (a function, a class, an instance): call it or read attributes."""

    __slots__ = ("_gen", "_id", "_what")

    def __init__(self, gen: int, hid: int, what: str) -> None:
        self._gen, self._id, self._what = gen, hid, what

    def __call__(self, *args: object, **kwargs: object) -> object:
        _, value, changed = _program.ask(["call", self, list(args), kwargs])
        for item in changed if type(changed) is list else ():  # in-place changes to arguments
            i, new = item if type(item) is list and len(item) == 2 else (-1, None)
            if type(i) is int and 0 <= i < len(args) and type(args[i]) is type(new):
                target: Any = args[i]
                if isinstance(target, list):
                    target[:] = new  # type: ignore[call-overload]
                else:
                    target.clear()
                    target.update(new)
        return value

    def __getattr__(self, name: str) -> object:
        if name in _Handle.__slots__:
            raise AttributeError(name)
        return _program.ask(["get", self, name])[1]

    def __repr__(self) -> str:
        return f"<the program's {self._what} object>"

    def _refuse(self, *args: object) -> Any:
        raise TypeError(
            f"the program gave a {self._what} object where tests need plain values "
            "(None, bool, numbers, str, bytes, list, tuple, dict, set)"
        )

    __eq__ = __ne__ = __lt__ = __le__ = __gt__ = __ge__ = _refuse
    __bool__ = __len__ = __iter__ = __contains__ = __getitem__ = _refuse
    __int__ = __float__ = __index__ = __complex__ = _refuse
    __hash__ = object.__hash__


def _alarm(signum: int, frame: object) -> None:
    raise _Timeout()


def _run_test(src: str, name: str, env: dict[str, object], limit: float) -> list[object]:
    """[status, detail, seconds] of one test (its code run in ``env``) under its time limit.

    The program is loaded first when no candidate holds it (the first test, or after a test
    ended the candidate): a failure there is the program's.
    """
    start, loading = time.perf_counter(), not _program.loaded
    try:
        try:
            signal.setitimer(signal.ITIMER_REAL, limit)
            if loading:
                _program.load(env)
                loading = False
            exec(compile(src, name, "exec"), env)
            status, detail = "passed", ""
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)
    except _Timeout:
        status, detail = "timeout", f"took longer than {limit:g}s"
    except MemoryError:
        status, detail = "memory", "MemoryError"
    except BaseException as e:
        status = "failed" if isinstance(e, AssertionError) and not loading else "runtime_error"
        detail = str(e)[:CLIP] if isinstance(e, (ProgramError, ProgramGone)) else describe(e)
        detail += where(e.__traceback__, name, src.splitlines())
    if loading:
        detail = "the program failed: " + detail
    return [status, detail, time.perf_counter() - start]


def _emit(text: str) -> None:
    view = memoryview((text + "\n").encode("ascii"))
    while view:
        view = view[os.write(_report, view) :]


def _read_back(fd: int, head: bool, n: int) -> str:
    size = os.fstat(fd).st_size
    return os.pread(fd, n, 0 if head else max(0, size - n)).decode("utf-8", "replace")


def _no_handle(x: object) -> str:
    raise TypeError(f"a {type(x).__name__} in the report")


def _checker() -> None:
    """Run the job on stdin; one JSON line per test on stdout, then the program's output."""
    fds = []
    for kind in ("out", "err"):  # the candidate's stdout and stderr: unlinked files
        path = f".{kind}-{os.getpid()}"
        fds.append(os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_APPEND, 0o600))
        os.unlink(path)
    with open("main.py", encoding="utf-8") as fh:
        _program.src, _program.out_fd, _program.err_fd = fh.read(), fds[0], fds[1]
    _program.start(fresh=True)  # forked before the job is read: it cannot hold any of it
    import ctypes

    if ctypes.CDLL(None, use_errno=True).prctl(4, 0, 0, 0, 0) != 0:  # PR_SET_DUMPABLE, 0
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_DUMPABLE, 0) failed")
    data = bytearray()
    while chunk := os.read(0, 1 << 16):
        data += chunk
    job: Any = loads(data.decode("ascii"))
    global _report
    _report = os.dup(1)  # what the tests or their imports print must not reach the report
    os.dup2(os.open(os.devnull, os.O_WRONLY), 1)
    _program.code, _program.site, limit = job["program"], bool(job["site"]), float(job["limit"])
    signal.signal(signal.SIGALRM, _alarm)
    env: dict[str, object] = {"__name__": "solution", "__builtins__": builtins}
    status, detail, took = _run_test("", "<load>", env, limit)
    for i, test in enumerate(job["tests"]):
        if status == "passed":
            result = _run_test(test, f"<test {i}>", env, limit)
        else:  # every test fails the way the program did
            result = [status, detail, took]
        _emit(dump([i, *result], _no_handle))
    _program.stop()
    report = ["out", _read_back(fds[0], True, 4096), _read_back(fds[1], False, 8192)]
    _emit(dump(report, _no_handle))


if __name__ == "__main__":
    if sys.argv[1:2] == ["candidate"]:
        _candidate()
    else:
        try:
            _checker()
        except BaseException as e:
            _emit(dump(["error", f"the test harness failed: {describe(e)}"], _no_handle))
            os._exit(1)
        os._exit(0)  # the report is written (os.write, unbuffered): skip the interpreter's teardown
