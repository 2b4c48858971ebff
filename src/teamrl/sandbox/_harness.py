"""The trusted test driver that runs *inside* the sandbox (stdlib only; the trainer never runs it).

The host starts it as ``python -I -S -c <this file's source> RESULT_FD UID GID SANDBOXED`` and writes
one JSON payload ``{"code", "setup", "tests", "modules", "limits", "sys_path", "relay", "record"}`` to
its stdin (``modules[i]``: the standard modules test ``i`` reads attributes of; a test is a snippet,
or a *direct call* ``{"call": NAME, "args": [...], "kwargs": [[NAME, VALUE], ...], "relay": [VALUE, ...]}``
of one of the program's functions, values as :func:`encode` writes them). Protocol on
RESULT_FD (a pipe only this process holds; one JSON object per line):

    {"ready": true}                      privileges dropped, payload read, before any model code runs
    {"index": i, "passed": ..., ...}     one line per test, in order
    {"done": true}                       every test reported

Who decides that a test passed. Model-written code can do anything its own process can do: patch any
module, write to any descriptor it holds, read its own memory, ``os._exit``, return an object whose
``__eq__`` always says yes. So it never runs in a process that decides an outcome, nor in one that
holds a test:

* the **driver** (this process) holds the code and the tests, forks everything else and reports;
* the **program server**, forked *before* the driver reads its payload, so its memory holds no test,
  receives only the code, compiles it and forks one **program process** per test, which runs the
  model-written code and answers calls;
* one **judge** per test, forked by the driver, runs that test's trusted code (the problem's own
  ``setup`` first). Every name the program defines is a proxy in the judge: calling it sends the
  arguments to the program process, which runs the call and sends the result back as *plain data*
  (None, bool, int, float, complex, str, bytes, and lists, tuples, sets and dicts of them), rebuilt by
  the judge as fresh built-in objects. Anything else comes back as an opaque handle, which equals only
  itself, has no truth value and can only be passed back to the program. The judge compares; it alone
  writes the outcome, on a pipe the program never holds.

Two things the cooperation measure of the coding reward needs (``teamrl.rewards.code``), both decided
by the judge alone:

* **Recorded calls** (``record``: a function's name): every call a test makes of that function is
  reported with the outcome, as the judge sent its arguments and decoded its result (``calls``).
* **A relayed function** (``relay``: a function's name): once the program is loaded, the program
  process replaces that global by a relay that tells the judge, at each call, the call's arguments
  and asks what to do: run the function (every snippet test, and a direct call without ``relay``), or
  return the next of the values a direct call's ``relay`` lists, without running it (a call beyond
  them raises). The relay is the same code in every run; only the judge's answer differs. The
  arguments the relay reported are listed with the outcome (``relayed``): the program's word for how
  it called the function, which it chooses anyway by calling it.

A program can therefore only influence its outcome by what its functions return (or raise). The
program process's own side of the protocol (the code that loads the program, answers the judge's
requests and encodes values) runs in the program's process, so the program can rewrite it: nothing
the judge receives is trusted. The names a test takes from the program are checked by the judge
(never a built-in's name, never a ``__dunder__``: the test's ``__builtins__`` is always the real
module), the standard modules a test reads are the judge's own imports, and every value is rebuilt
from plain data. It never sees a test's expected values: they are neither in its memory nor in its
file system. The driver and judges are non-dumpable, so no program process can read their memory or
open their descriptors through ``/proc``; a program that kills or stops them loses its own remaining
tests, nothing more.
"""

import _socket  # not `socket`: its import slows every sandbox's start (docs/reports/sandbox-throughput.md, issue #22)
import array
import builtins
import json
import os
import re
import resource
import select
import signal
import sys
import time

_PR_SET_DUMPABLE = 4
_COMPARE_MARKER = "teamrl-compare"  # must equal teamrl.sandbox.asserts.COMPARE_MARKER
# Cheap standard modules the program server imports before forking when the program imports them, so
# each program process inherits them instead of importing them again (third-party modules never: they
# would run in the server, outside the program's resource limits).
_PRELOADABLE = {"typing", "math", "collections", "itertools", "functools", "heapq", "bisect", "string",
                "hashlib", "operator", "fractions", "decimal", "statistics", "re", "random", "copy"}
_IMPORTED = re.compile(r"^[ \t]*(?:from|import)[ \t]+([A-Za-z_]\w*)", re.MULTILINE)
_OUTCOME_KEYS = {"passed": bool, "error_type": str, "message": str, "expected": str, "actual": str,
                 "phase": str, "limit": str, "line": int, "program_ended": bool, "calls": list,
                 "relayed": list}
_MAX_OUTCOME_BYTES = 1 << 16
#: Most bytes of recorded calls a test's outcome carries; beyond, the record says only that it was cut.
_MAX_RECORD_BYTES = 1 << 14
#: Most calls of the recorded function a test's outcome lists.
_MAX_RECORDED_CALLS = 16
#: Largest message between a judge and its program process (one call's arguments or result).
_MAX_FRAME_BYTES = 16 << 20
#: Program globals sent to the judge as plain data only up to this size (larger ones become handles).
_MAX_GLOBAL_BYTES = 1 << 16
_FRAME_HEADER_BYTES = 4
# Built-in exceptions a program's error is re-raised as in the judge, so that a test catching one
# works; control-flow exceptions never are (a StopIteration from the program must not end a test's
# loop early, a SystemExit must not end the judge).
_NOT_RERAISED = {"StopIteration", "StopAsyncIteration", "GeneratorExit", "KeyboardInterrupt", "SystemExit"}
# Standard modules that act when imported: a program that imported them does not make the judge do so.
_NOT_IMPORTED = {"antigravity", "this", "idlelib", "turtle", "turtledemo", "tkinter", "webbrowser"}


# ------------------------------------------------------------------------------------------------
# Values across the program/judge boundary: JSON with tags for what JSON lacks.


class ProtocolError(Exception):
    """A message from the program process that is not a valid reply."""


def encode(value, on_other, depth=0):
    """``value`` as JSON-ready data: plain data as itself (tagged where JSON has no such type), any
    other object as ``on_other(value)``. Instances of subclasses of the plain types count as their
    base type, read through the base type's own methods (a ``Counter`` is a dict; an ``int`` subclass
    with a lying ``__eq__`` is its integer)."""
    if depth > 200:
        raise RecursionError("value nested too deeply")
    if value is None or type(value) is bool:
        return value
    if isinstance(value, int):
        return int.__int__(value)
    if isinstance(value, float):
        return float.__float__(value)
    if isinstance(value, str):
        return str.__str__(value)
    if isinstance(value, complex):
        value = complex(value)
        return {"c": [value.real, value.imag]}
    if isinstance(value, (bytes, bytearray)):
        return {"ba" if isinstance(value, bytearray) else "b": bytes.hex(bytes(value))}
    if isinstance(value, list):
        return [encode(item, on_other, depth + 1) for item in list.__iter__(value)]
    if isinstance(value, tuple):
        return {"t": [encode(item, on_other, depth + 1) for item in tuple.__iter__(value)]}
    if isinstance(value, frozenset):
        return {"fs": [encode(item, on_other, depth + 1) for item in frozenset.__iter__(value)]}
    if isinstance(value, set):
        return {"s": [encode(item, on_other, depth + 1) for item in set.__iter__(value)]}
    if isinstance(value, dict):
        return {"d": [[encode(k, on_other, depth + 1), encode(v, on_other, depth + 1)]
                      for k, v in dict.items(value)]}
    return on_other(value)


def decode(data, on_handle, on_module=None):
    """Inverse of :func:`encode`: fresh built-in objects; ``{"h": ...}`` through ``on_handle``.

    Raises:
        ProtocolError: ``data`` is not something :func:`encode` makes.
    """
    try:
        return _decode(data, on_handle, on_module)
    except ProtocolError:
        raise
    except (TypeError, ValueError, RecursionError, MemoryError) as error:
        raise ProtocolError(f"malformed value ({type(error).__name__})") from None


def _decode(data, on_handle, on_module):
    if data is None or isinstance(data, (bool, int, float, str)):
        return data
    if isinstance(data, list):
        return [_decode(item, on_handle, on_module) for item in data]
    if not (isinstance(data, dict) and len(data) == 1):
        raise ProtocolError("unexpected value")
    ((tag, body),) = data.items()
    if tag in ("t", "s", "fs") and isinstance(body, list):
        items = [_decode(item, on_handle, on_module) for item in body]
        return {"t": tuple, "s": set, "fs": frozenset}[tag](items)
    if tag == "d" and isinstance(body, list):
        pairs = []
        for pair in body:
            if not (isinstance(pair, list) and len(pair) == 2):
                raise ProtocolError("malformed dict")
            pairs.append((_decode(pair[0], on_handle, on_module), _decode(pair[1], on_handle, on_module)))
        return dict(pairs)
    if tag in ("b", "ba") and isinstance(body, str):
        return (bytes if tag == "b" else bytearray).fromhex(body)
    if tag == "c" and isinstance(body, list) and len(body) == 2 and all(type(x) in (int, float) for x in body):
        return complex(float(body[0]), float(body[1]))
    if tag == "h":
        return on_handle(body)
    if tag == "m" and on_module is not None and isinstance(body, str):
        return on_module(body)
    raise ProtocolError(f"unexpected tag {tag[:20]!r}")


def _send_frame(fd, message):
    data = json.dumps(message, separators=(",", ":")).encode()
    data = len(data).to_bytes(_FRAME_HEADER_BYTES, "big") + data
    while data:
        data = data[os.write(fd, data):]


def _read_exactly(fd, size):
    """``size`` bytes from ``fd``; ProgramEnded at end of file (every writer has closed or exited)."""
    chunks, missing = [], size
    while missing:
        chunk = os.read(fd, min(missing, 1 << 20))
        if not chunk:
            raise ProgramEnded()
        chunks.append(chunk)
        missing -= len(chunk)
    return b"".join(chunks)


def _read_frame(fd):
    size = int.from_bytes(_read_exactly(fd, _FRAME_HEADER_BYTES), "big")
    if size > _MAX_FRAME_BYTES:
        raise ProtocolError(f"a message of {size} bytes (the most is {_MAX_FRAME_BYTES})")
    try:
        return json.loads(_read_exactly(fd, size))
    except (ValueError, UnicodeDecodeError, RecursionError, MemoryError) as error:
        raise ProtocolError(f"not JSON ({type(error).__name__})") from None


def _safe_repr(value, limit):
    try:
        text = repr(value)
    except BaseException as error:  # a hostile __repr__ must not hide the failure itself
        text = f"<repr failed: {type(error).__name__}>"
    if not isinstance(text, str):
        text = f"<repr returned {type(text).__name__}>"
    return text if len(text) <= limit else text[:limit] + "..."


# ------------------------------------------------------------------------------------------------
# The judge's side: proxies for the program's names, and the outcome of one test.


class ProgramEnded(BaseException):
    """The program process ended (or closed its pipe) before answering. A BaseException, so that a
    test's ``except Exception`` does not swallow it."""


class ProgramLoadFailed(BaseException):
    """Loading the program raised; carries the program process's description of the error."""

    def __init__(self, report):
        super().__init__(report["message"])
        self._teamrl_report = report


class ProgramError(Exception):
    """An exception the program raised that the judge does not re-raise as its built-in type."""


class RemoteObject:
    """A program object the judge holds by reference: it can be called, have attributes read and be
    passed back to the program; it equals only itself and has no truth value, length or iteration."""

    __slots__ = ("_channel", "_id", "_type", "_repr", "_callable")

    def __init__(self, channel, body):
        if not (isinstance(body, list) and len(body) == 4 and type(body[0]) is int and isinstance(body[1], str)
                and isinstance(body[2], str) and isinstance(body[3], bool)):
            raise ProtocolError("malformed handle")
        limit = channel.limit
        object.__setattr__(self, "_channel", channel)
        object.__setattr__(self, "_id", body[0])
        object.__setattr__(self, "_type", body[1][:100])
        object.__setattr__(self, "_repr", body[2][:limit])
        object.__setattr__(self, "_callable", body[3])

    def __call__(self, *args, **kwargs):
        if not self._callable:
            raise TypeError(f"'{self._type}' object is not callable")
        return self._channel.request("call", self._id, args=list(args), kwargs=kwargs)

    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return self._channel.request("getattr", self._id, name=name)

    def __setattr__(self, name, value):
        raise TypeError(f"a test cannot set attributes of the program's {self._type} object")

    def __repr__(self):
        return self._repr

    def __bool__(self):
        raise TypeError(f"the program returned a {self._type} object, which has no truth value outside the program: "
                        "return plain data (numbers, strings, lists, tuples, dicts, sets, None)")

    def __eq__(self, other):
        return isinstance(other, RemoteObject) and other._id == self._id

    def __ne__(self, other):
        return not self.__eq__(other)

    def __hash__(self):
        return hash(("teamrl-remote", self._id))


#: The judge's answers to a relayed function's call (``{"relay": {"args", "kwargs"}}``, see the module
#: docstring): run it, return a value, or raise (no value left).
_RUN = {"run": True}
_NONE_LEFT = {"none_left": True}
#: Most relayed calls a test's outcome lists; beyond, the list says only that it was cut.
_MAX_RELAYED_CALLS = 64


class _Channel:
    """The judge's end of the pipes to its program process (which alone holds their other ends, so a
    program process that ends is seen as the end of its reply pipe).

    ``relay_values`` is how the judge answers a relayed function's calls: None where the program has
    none (then such a question is a protocol error), ``_RUN`` (run it), or a list of values to return
    in turn. ``relayed`` lists the calls' arguments as the program reported them."""

    def __init__(self, request_fd, reply_fd, limit, relay_values=None):
        self.request_fd, self.reply_fd, self.limit = request_fd, reply_fd, limit
        self.relay_values = relay_values
        self.relayed = []
        self.sequence = 0

    def _reference(self, value):
        if isinstance(value, RemoteObject):
            return {"h": value._id}
        raise TypeError(f"a {type(value).__name__} cannot be passed to the program: only plain data and "
                        "objects the program returned can")

    def _handle(self, body):
        return RemoteObject(self, body)

    @staticmethod
    def _module(name):
        if not re.fullmatch(r"[A-Za-z_]\w*(\.[A-Za-z_]\w*)*", name):
            raise ProtocolError("malformed module name")
        if name.split(".")[0] not in sys.stdlib_module_names or name in _NOT_IMPORTED:
            return None
        try:
            # Imported here, from the sandbox's read-only library: the judge never uses the program's
            # copy of a module, which the program may have patched.
            __import__(name)
            return sys.modules[name]
        except ImportError:
            return None

    def exchange(self, message):
        self.sequence += 1
        message["seq"] = self.sequence
        self._send(message)
        reply = _read_frame(self.reply_fd)
        # While the program answers, a relayed function it calls asks what to do, as often as it calls it.
        while isinstance(reply, dict) and set(reply) == {"relay"} and self.relay_values is not None:
            self._send(self._relay_answer(reply["relay"]))
            reply = _read_frame(self.reply_fd)
        if not isinstance(reply, dict) or reply.get("seq") != self.sequence:
            raise ProtocolError("a reply out of sequence")
        return reply

    def _relay_answer(self, call):
        count = len(self.relayed)
        if count < _MAX_RELAYED_CALLS:
            recorded = isinstance(call, dict) and set(call) == {"args", "kwargs"}
            self.relayed.append(call if recorded else {"unrecordable": True})
        elif count == _MAX_RELAYED_CALLS:
            self.relayed.append({"unrecordable": True})
        if self.relay_values is _RUN:
            return _RUN
        return {"value": self.relay_values[count]} if count < len(self.relay_values) else _NONE_LEFT

    def _send(self, message):
        try:
            _send_frame(self.request_fd, message)
        except BrokenPipeError:
            raise ProgramEnded() from None

    def names(self):
        """The program's global names a test may use: its functions and classes (as proxies), its
        plain-data globals and the modules it imported (imported again here). Never a name of a
        built-in (a program's ``abs = lambda x: 0`` must not answer for the test's ``abs``), nor a
        ``__dunder__`` name, nor any other kind of object. Raises ProgramLoadFailed."""
        reply = self.exchange({"op": "names"})
        if isinstance(reply.get("load_error"), dict):
            raise ProgramLoadFailed(_error_report(reply["load_error"], self.limit))
        names = reply.get("names")
        if not isinstance(names, dict):
            raise ProtocolError("malformed names")
        values = {}
        for name, data in names.items():
            # The program's side of the protocol is the program's to rewrite (it runs in its process), so
            # whatever it names is checked here: never a dunder (``__builtins__`` would choose the
            # functions the test's own code calls), never a built-in's name.
            if not name.isidentifier() or name.startswith("__") or name in builtins.__dict__:
                continue
            value = decode(data, self._handle, self._module)
            if isinstance(value, RemoteObject) and not value._callable:
                continue
            if value is not None or data is None:
                values[name] = value
        return values

    def request(self, op, target, **fields):
        message = {"op": op, "target": target}
        for key, value in fields.items():
            if key == "kwargs":
                value = [[name, encode(item, self._reference)] for name, item in value.items()]
            elif key == "args":
                value = encode(value, self._reference)
            message[key] = value
        reply = self.exchange(message)
        if "value" in reply:
            return decode(reply["value"], self._handle)
        if isinstance(reply.get("error"), dict):
            raise _program_exception(_error_report(reply["error"], self.limit))
        raise ProtocolError("a reply with neither value nor error")


def _error_report(raw, limit):
    """Only well-typed fields of an error description the program process sent."""
    report = {"type": "Exception", "message": ""}
    if isinstance(raw.get("type"), str) and raw["type"].isidentifier():
        report["type"] = raw["type"][:100]
    if isinstance(raw.get("message"), str):
        report["message"] = raw["message"][:limit]
    for key in ("line", "errno"):
        if type(raw.get(key)) is int:
            report[key] = raw[key]
    return report


def _program_exception(report):
    """The exception a call into the program raises in the judge: the built-in exception of the same
    name when there is one (so tests that expect it work), else a ProgramError."""
    kind = getattr(builtins, report["type"], None)
    error = None
    if (isinstance(kind, type) and issubclass(kind, Exception) and report["type"] not in _NOT_RERAISED):
        try:
            error = kind(report["errno"], report["message"]) if "errno" in report and issubclass(
                kind, OSError) else kind(report["message"])
        except Exception:
            error = None
    if error is None:
        error = ProgramError(report["message"])
    error._teamrl_report = report
    return error


def describe_failure(error, phase, limit):
    """The outcome dict for a test that raised ``error`` (any BaseException, SystemExit included)."""
    if isinstance(error, ProgramEnded):
        return {"passed": False, "program_ended": True}
    if isinstance(error, ProtocolError):
        return {"passed": False, "error_type": "NoResult", "phase": phase,
                "message": f"the program's answer was not a valid reply: {error}"}
    report = getattr(error, "_teamrl_report", None)
    outcome = {"passed": False, "error_type": type(error).__name__, "phase": phase}
    args = getattr(error, "args", ())
    if isinstance(error, AssertionError) and len(args) == 6 and args[0] == _COMPARE_MARKER:
        _, left, right, operator, message, left_is_actual = args
        left, right = _safe_repr(left, limit), _safe_repr(right, limit)
        outcome["actual"], outcome["expected"] = (left, right) if left_is_actual else (right, left)
        if operator == "==":
            detail = "expected {}, got {}".format(outcome["expected"], outcome["actual"])
        else:
            detail = f"{left} {operator} {right} is false"
        outcome["message"] = (_safe_repr(message, limit) + ": " + detail) if message is not None else detail
    elif report is not None:
        outcome["error_type"], outcome["message"] = report["type"], report["message"]
        if "line" in report:
            outcome["line"] = report["line"]
    else:
        try:
            outcome["message"] = str(error)[:limit]
        except BaseException:
            outcome["message"] = "<str failed>"
    kind = _classify(outcome["error_type"], (report or {}).get("errno", getattr(error, "errno", None)))
    if kind:
        outcome["limit"] = kind
    return outcome


def _classify(error_type, errno):
    if error_type == "MemoryError":
        return "memory"
    if errno == 27:  # EFBIG: RLIMIT_FSIZE (Python ignores SIGXFSZ)
        return "file_size"
    if error_type == "BlockingIOError":  # EAGAIN from fork/spawn under RLIMIT_NPROC
        return "processes"
    return None


class _Unrecordable(Exception):
    """A value of a recorded call that is not plain data."""


def _refuse(value):
    raise _Unrecordable()


def _recorded(args, kwargs, result=None, raised=False):
    """One call as an outcome lists it: its arguments and result as :func:`encode` writes them."""
    try:
        call = {"args": encode(list(args), _refuse), "kwargs": encode(dict(kwargs), _refuse)}
        if raised:
            call["raised"] = True
        else:
            call["result"] = encode(result, _refuse)
        return call
    except (_Unrecordable, RecursionError):
        return {"unrecordable": True}


class _Recorder:
    """Stands for the program's recorded function in a test: calls it and notes each call."""

    __slots__ = ("_function", "calls")

    def __init__(self, function):
        self._function, self.calls = function, []

    def __call__(self, *args, **kwargs):
        try:
            result = self._function(*args, **kwargs)
        except BaseException:
            self.calls.append(_recorded(args, kwargs, raised=True))
            raise
        self.calls.append(_recorded(args, kwargs, result))
        return result

    def __getattr__(self, name):
        return getattr(self._function, name)


def _bounded(calls):
    """The recorded calls, or one entry saying they were too many or too large to report."""
    if len(calls) > _MAX_RECORDED_CALLS or len(json.dumps(calls)) > _MAX_RECORD_BYTES:
        return [{"unrecordable": True}]
    return calls


def judge(test, setup, modules, channel, limit, record=None):
    """Run one test's trusted code against proxies of the program; return the outcome dict.

    ``modules``: the standard modules the test reads attributes of (``math`` of ``math.isclose``); they
    are the judge's own, whatever the program bound to their names (a class named ``math`` whose
    ``isclose`` says yes must not answer for the test). ``record``: the name of the program function
    whose calls the outcome lists (``calls``), or None.
    """
    namespace = {"__name__": "__teamrl_test__"}
    phase = "program"
    recorder = None
    try:
        namespace.update(channel.names())
        for name in modules:
            namespace.pop(name, None)
            module = _Channel._module(name)
            if module is not None:
                namespace[name] = module
        namespace["__builtins__"] = builtins
        phase = "test"
        # The problem's own definitions (e.g. a helper the test calls) come from the trusted setup,
        # not from the program, which might have redefined them.
        exec(setup, namespace)
        if record is not None and isinstance(namespace.get(record), RemoteObject):
            recorder = namespace[record] = _Recorder(namespace[record])
        exec(test, namespace)
    except ProgramLoadFailed as failure:
        outcome = describe_failure(failure, "program", limit)
    except BaseException as error:  # SystemExit and KeyboardInterrupt are failures too
        outcome = describe_failure(error, phase, limit)
    else:
        outcome = {"passed": True}
    if recorder is not None:
        outcome["calls"] = _bounded(recorder.calls)
    return _with_relayed(outcome, channel)


def _with_relayed(outcome, channel):
    if channel.relayed:
        outcome["relayed"] = channel.relayed if len(json.dumps(channel.relayed)) <= _MAX_RECORD_BYTES \
            else [{"unrecordable": True}]
    return outcome


def call_directly(call, channel, limit):
    """Call one of the program's functions with the arguments ``call`` gives (a direct-call test, see
    the module docstring); the outcome lists the call. It passes when the function returns."""
    try:
        function = channel.names().get(call["call"])
        if not (isinstance(function, RemoteObject) and function._callable):
            raise NameError(f"the program defines no function {call['call']!r}")
        args = decode(call["args"], _refuse_handle)
        kwargs = {name: decode(value, _refuse_handle) for name, value in call["kwargs"]}
        result = function(*args, **kwargs)
    except ProgramLoadFailed as failure:
        return _with_relayed(describe_failure(failure, "program", limit), channel)
    except BaseException as error:
        return _with_relayed(describe_failure(error, "test", limit), channel)
    return _with_relayed({"passed": True, "calls": _bounded([_recorded(args, kwargs, result)])}, channel)


def _refuse_handle(body):
    raise ProtocolError("a direct call's arguments hold a handle")


# ------------------------------------------------------------------------------------------------
# The program's side: the server that forks program processes, and one program process.


def _program_line(error):
    """The line of the program where ``error`` was raised (or, for a SyntaxError, found), if any."""
    if isinstance(error, SyntaxError) and error.filename == "<program>":
        return error.lineno
    line, traceback = None, error.__traceback__
    while traceback is not None:
        if traceback.tb_frame.f_code.co_filename == "<program>":
            line = traceback.tb_lineno
        traceback = traceback.tb_next
    return line


def _describe_program_error(error, limit):
    report = {"type": type(error).__name__, "message": _safe_text(error, limit)}
    line = _program_line(error)
    if line is not None:
        report["line"] = line
    if isinstance(error, OSError) and isinstance(error.errno, int):
        report["errno"] = error.errno
    return report


def _safe_text(error, limit):
    try:
        return str(error)[:limit]
    except BaseException:
        return "<str failed>"


class _Handles:
    """Objects of the program process that the judge holds by reference."""

    def __init__(self, limit):
        self.limit, self.objects, self.by_id = limit, [], {}

    def make(self, value):
        key = id(value)
        if key not in self.by_id:
            self.by_id[key] = len(self.objects)
            self.objects.append(value)
        return {"h": [self.by_id[key], _safe_text(type(value).__name__, 100),
                      _safe_repr(value, self.limit), callable(value)]}

    def resolve(self, body):
        if type(body) is not int or not 0 <= body < len(self.objects):
            raise ProtocolError("unknown handle")
        return self.objects[body]


def _flush_output():
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except BaseException:
            pass


def _encode_global(value, handles):
    if type(value).__name__ == "module" and isinstance(getattr(value, "__name__", None), str):
        return {"m": value.__name__}
    data = encode(value, handles.make)
    if len(json.dumps(data)) > _MAX_GLOBAL_BYTES:
        return handles.make(value)
    return data


def _answer(request, namespace, load_error, handles, limit):
    """The program process's reply to one judge request."""
    reply = {"seq": request.get("seq")}
    op = request.get("op")
    if op == "names":
        if load_error is not None:
            reply["load_error"] = load_error
        else:
            reply["names"] = {name: _encode_global(value, handles) for name, value in list(namespace.items())
                              if isinstance(name, str) and not name.startswith("__")}
        return reply
    try:
        target = handles.resolve(request.get("target"))
        if op == "call":
            args = decode(request.get("args"), handles.resolve)
            kwargs = {name: decode(value, handles.resolve) for name, value in request.get("kwargs", [])}
            result = target(*args, **kwargs)
        elif op == "getattr":
            result = getattr(target, request.get("name"))
        else:
            raise ProtocolError("unknown request")
    except BaseException as error:  # the program's own exceptions, SystemExit included, are its answer
        reply["error"] = _describe_program_error(error, limit)
        return reply
    try:
        reply["value"] = encode(result, handles.make)
    except RecursionError:  # nested too deeply (or cyclic) to be plain data: held by reference
        reply["value"] = handles.make(result)
    return reply


class RelayedCallUnanswered(Exception):
    """A relayed function was called more often than the judge had values for (module docstring)."""


def _relay(function, request_fd, reply_fd):
    """What stands for a relayed function once the program is loaded (see the module docstring): each
    call (but one from within the function itself) tells the judge its arguments, then runs
    ``function``, returns the value the judge sent or raises."""
    inside = []  # calls of the function from within itself (recursion) run as they are

    def relay(*args, **kwargs):
        if inside:
            return function(*args, **kwargs)
        try:
            call = {"args": encode(list(args), _refuse), "kwargs": encode(dict(kwargs), _refuse)}
        except (_Unrecordable, RecursionError):
            call = None
        _send_frame(reply_fd, {"relay": call})
        answer = _read_frame(request_fd)
        if isinstance(answer, dict) and "value" in answer:
            return decode(answer["value"], _refuse_handle)
        if answer == _NONE_LEFT:
            raise RelayedCallUnanswered("no answer left for this call")
        inside.append(True)
        try:
            return function(*args, **kwargs)
        finally:
            inside.pop()
    return relay


def _program_process(code, request_fd, reply_fd, limits, relay):
    """Body of a program process (a fork of the program server): load the program, put the relay in
    place of the function named ``relay`` (if any), answer the judge's requests until it closes the
    pipe. Never returns."""
    try:
        os.setpgid(0, 0)
        _keep_only_descriptors({0, 1, 2, request_fd, reply_fd})
        _set_limits(limits)
        limit = limits["max_message_chars"]
        namespace = {"__name__": "__teamrl_program__", "__builtins__": builtins}
        load_error = None
        try:
            if isinstance(code, BaseException):
                raise code
            exec(code, namespace)
            if relay is not None and callable(namespace.get(relay)):
                namespace[relay] = _relay(namespace[relay], request_fd, reply_fd)
        except BaseException as error:
            load_error = _describe_program_error(error, limit)
        _flush_output()
        handles = _Handles(limit)
        while True:
            request = _read_frame(request_fd)
            reply = _answer(request, namespace, load_error, handles, limit) if isinstance(request, dict) else {}
            _flush_output()
            _send_frame(reply_fd, reply)
    finally:
        os._exit(0)


def _keep_only_descriptors(keep):
    for entry in os.listdir("/proc/self/fd"):
        if int(entry) not in keep:
            try:
                os.close(int(entry))
            except OSError:  # the directory's own descriptor, already closed
                pass


def _set_limits(limits):
    cpu = int(limits["cpu_time_s"])
    for kind, soft, hard in ((resource.RLIMIT_CPU, cpu, cpu + 1),
                             (resource.RLIMIT_AS, limits["memory_bytes"], limits["memory_bytes"]),
                             (resource.RLIMIT_NPROC, limits["max_processes"], limits["max_processes"]),
                             (resource.RLIMIT_FSIZE, limits["max_file_bytes"], limits["max_file_bytes"]),
                             (resource.RLIMIT_NOFILE, limits["max_open_files"], limits["max_open_files"]),
                             (resource.RLIMIT_CORE, 0, 0)):
        _, current_hard = resource.getrlimit(kind)
        if current_hard != resource.RLIM_INFINITY:  # an unprivileged process cannot raise its hard limit
            soft, hard = min(soft, current_hard), min(hard, current_hard)
        resource.setrlimit(kind, (soft, hard))


def _program_server(control, code_fd):
    """Body of the program server: never returns. It reads the code from ``code_fd``; each message on
    ``control`` carries a program process's two pipe ends, answered with the process's pid and then,
    once it has ended, its wait status and CPU time."""
    try:
        with os.fdopen(code_fd, "rb") as code_pipe:
            setup = json.loads(code_pipe.read())
        sys.path.extend(setup["sys_path"])
        try:
            code = compile(setup["code"], "<program>", "exec")
        except BaseException as error:  # reported by each program process as the program's failure
            code = error
        _preload(setup["code"])
        while True:
            message, fds = _receive_descriptors(control, 2)
            if not message or len(fds) != 2:
                break
            pid = os.fork()
            if pid == 0:
                control.close()
                _program_process(code, fds[0], fds[1], setup["limits"], setup["relay"])
            for fd in fds:
                os.close(fd)
            try:
                os.setpgid(pid, pid)
            except OSError:  # the child already did it, or already exited
                pass
            control.send(json.dumps({"pid": pid}).encode())
            _, status, rusage = os.wait4(pid, 0)
            control.send(json.dumps({"status": status, "cpu": rusage.ru_utime + rusage.ru_stime}).encode())
    finally:
        os._exit(0)


def _send_descriptors(sock, message, fds):
    sock.sendmsg([message], [(_socket.SOL_SOCKET, _socket.SCM_RIGHTS, array.array("i", fds))])


def _receive_descriptors(sock, count):
    """One message and the descriptors that came with it (at most ``count``)."""
    message, ancillary, _, _ = sock.recvmsg(1024, _socket.CMSG_LEN(count * array.array("i").itemsize))
    fds = array.array("i")
    for level, kind, data in ancillary:
        if level == _socket.SOL_SOCKET and kind == _socket.SCM_RIGHTS:
            fds.frombytes(data[:len(data) - len(data) % fds.itemsize])
    return message, list(fds)


def _preload(source):
    for name in set(_IMPORTED.findall(source)) & _PRELOADABLE:
        try:
            __import__(name)
        except ImportError:  # the program or test will report it
            pass


class ServerLost(Exception):
    """The program server is gone (the program killed it): no further program process can start."""


class _Server:
    """The driver's end of the program server."""

    def __init__(self, result_fd):
        self.control, server_end = _socket.socketpair(_socket.AF_UNIX, _socket.SOCK_SEQPACKET)
        code_r, self.code_w = os.pipe()
        self.pid = os.fork()
        if self.pid == 0:
            # Before the payload is read: this process and its program processes never hold a test.
            null = os.open(os.devnull, os.O_RDONLY)
            os.dup2(null, 0)
            _keep_only_descriptors({0, 1, 2, server_end.fileno(), code_r})
            _program_server(server_end, code_r)
        server_end.close()
        os.close(code_r)

    def start(self, code, limits, sys_path, relay):
        """Send the program (and only the program) to the server."""
        with os.fdopen(self.code_w, "wb") as code_pipe:
            code_pipe.write(json.dumps({"code": code, "limits": limits, "sys_path": sys_path,
                                        "relay": relay}).encode())

    def _receive(self, deadline):
        remaining = None if deadline is None else max(deadline - time.monotonic(), 0)
        self.control.settimeout(remaining)
        try:
            data = self.control.recv(1024)
        except OSError:  # a timeout included
            raise ServerLost() from None
        if not data:
            raise ServerLost()
        return json.loads(data)

    def spawn(self, request_r, reply_w, deadline):
        """Start a program process on these pipe ends; its pid."""
        try:
            _send_descriptors(self.control, b"spawn", [request_r, reply_w])
        except OSError:
            raise ServerLost() from None
        message = self._receive(deadline)
        while "pid" not in message:  # the late exit report of an earlier program process
            message = self._receive(deadline)
        return message["pid"]

    def wait_exit(self, deadline):
        """(wait status, CPU seconds) of the last program process, once the server has reaped it."""
        message = self._receive(deadline)
        return message["status"], message["cpu"]


# ------------------------------------------------------------------------------------------------
# The driver.


def _parse_outcome(data):
    """Keep only well-typed known keys of a judge's report; None when it is not a report."""
    try:
        raw = json.loads(data.decode())
    except (ValueError, UnicodeDecodeError):
        return None
    if not isinstance(raw, dict) or not isinstance(raw.get("passed"), bool):
        return None
    return {key: raw[key] for key, kind in _OUTCOME_KEYS.items() if isinstance(raw.get(key), kind)}


def _kill_group(pgid):
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def _kill_process(pid):
    try:
        os.kill(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def _living_processes(keep):
    """Pids of this PID namespace's processes other than init and ``keep``, zombies left out."""
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit() and int(entry) != 1 and int(entry) not in keep:
            try:
                with open(f"/proc/{entry}/stat") as stat:
                    state = stat.read().rsplit(")", 1)[1].split()[0]
            except (OSError, IndexError):
                continue
            if state not in ("Z", "X"):
                found.append(int(entry))
    return found


def _kill_strays(keep, patience_s=2.0):
    """Kill every process of the sandbox but init and ``keep`` (daemons that left their process group),
    until none is left; False when some still live after ``patience_s`` (a fork bomb outrunning us)."""
    give_up, pause = time.monotonic() + patience_s, 0.001
    while True:
        strays = _living_processes(keep)
        if not strays:
            return True
        if time.monotonic() > give_up:
            return False
        for pid in strays:
            _kill_process(pid)
        time.sleep(pause)  # a killed process lives on until the kernel has torn it down
        pause = min(2 * pause, 0.05)


def _signal_name(number):
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"SIG{number}"


def _timed_out(limits):
    return {"passed": False, "error_type": "Timeout", "timed_out": True, "limit": "wall_time",
            "message": "test did not finish in time (limits: {:.1f} s per test, {:.1f} s per program)".format(
                limits["test_timeout_s"], limits["program_timeout_s"])}


def _program_ended(status, cpu, limits):
    """Outcome of a test whose program process ended before answering (killed, os._exit, crash)."""
    if status is None:
        return {"passed": False, "error_type": "NoResult", "message": "the program process ended before answering"}
    if os.WIFSIGNALED(status):
        number = os.WTERMSIG(status)
        outcome = {"passed": False, "error_type": "Killed", "signal": _signal_name(number),
                   "message": f"program process killed by {_signal_name(number)}"}
        if number == signal.SIGXCPU or (number == signal.SIGKILL and cpu >= limits["cpu_time_s"]):
            outcome["limit"] = "cpu_time"
            outcome["message"] += " (CPU time limit of {} s)".format(limits["cpu_time_s"])
        elif number == signal.SIGXFSZ:
            outcome["limit"] = "file_size"
        return outcome
    return {"passed": False, "error_type": "NoResult",
            "message": f"program process exited with status {os.WEXITSTATUS(status)} without answering"}


def run_one(server, test, settings, limits, deadline, own_pid_namespace):
    """Run one test (its code and the standard modules it reads, see :func:`judge`, or a direct call,
    see :func:`call_directly`) under the program's ``settings`` (``setup``, ``relay``, ``record``): a program process
    from the server, a judge forked here; wait for the judge's outcome or the deadline, then end every
    process of the test and return the outcome."""
    started = time.monotonic()
    request_r, request_w = os.pipe()
    reply_r, reply_w = os.pipe()
    try:
        program = server.spawn(request_r, reply_w, deadline)
    except ServerLost:
        os.close(request_w)
        os.close(reply_r)
        raise
    finally:
        os.close(request_r)
        os.close(reply_w)
    outcome_r, outcome_w = os.pipe()
    judge_pid = os.fork()
    if judge_pid == 0:
        try:
            _keep_only_descriptors({0, 1, 2, request_w, reply_r, outcome_w})
            _set_judge_limits(limits)
            body, modules = test
            direct = isinstance(body, dict)
            relay_values = None if settings["relay"] is None \
                else body["relay"] if direct and "relay" in body else _RUN
            channel = _Channel(request_w, reply_r, limits["max_message_chars"], relay_values)
            outcome = call_directly(body, channel, limits["max_message_chars"]) if direct \
                else judge(body, settings["setup"], modules, channel, limits["max_message_chars"], settings["record"])
            _flush_output()
            os.write(outcome_w, json.dumps(outcome).encode()[:_MAX_OUTCOME_BYTES])
        finally:
            os._exit(0)
    for fd in (request_w, reply_r, outcome_w):
        os.close(fd)
    data, reported = _collect(outcome_r, judge_pid, deadline)
    os.close(outcome_r)
    _kill_group(program)  # the program process and what it forked
    _kill_process(program)  # even if it left its process group
    _kill_process(judge_pid)
    os.waitpid(judge_pid, 0)
    try:
        status, cpu = server.wait_exit(time.monotonic() + 10.0)
    except ServerLost:
        status, cpu = None, 0.0
    if own_pid_namespace and not _kill_strays({os.getpid(), server.pid}):
        os.kill(-1, signal.SIGKILL)  # takes the server too: the remaining tests are not run
    outcome = _parse_outcome(data) if reported else None
    if not reported:
        outcome = _timed_out(limits)
    elif outcome is None:
        outcome = {"passed": False, "error_type": "NoResult",
                   "message": "the test's judge ended without an outcome (the program stopped it)"}
    elif outcome.pop("program_ended", False):
        outcome = _program_ended(status, cpu, limits)
    outcome["duration_s"] = round(time.monotonic() - started, 4)
    return outcome


def _collect(fd, pid, deadline):
    """Read the judge's outcome until it exits or ``deadline``: (data, whether it ended in time)."""
    pidfd = os.pidfd_open(pid)
    os.set_blocking(fd, False)
    poller = select.poll()
    poller.register(fd, select.POLLIN)
    poller.register(pidfd, select.POLLIN)
    data, exited, reading = b"", False, True
    try:
        while not exited:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                break
            for ready, _ in poller.poll(remaining * 1000):
                if ready == pidfd:
                    exited = True
                elif reading:
                    data, reading = _read_some(fd, data, poller)
        if exited and reading:
            data, _ = _read_some(fd, data, poller)
    finally:
        os.close(pidfd)
    return data, exited


def _read_some(fd, data, poller):
    """Read what is available (capped); returns the data and whether the pipe is still open."""
    try:
        chunk = os.read(fd, 1 << 16)
    except BlockingIOError:
        return data, True
    if not chunk:
        poller.unregister(fd)
        return data, False
    return (data + chunk)[:_MAX_OUTCOME_BYTES], True


def _set_judge_limits(limits):
    # Trusted code, but it decodes what the program sends: bounded like the program.
    resource.setrlimit(resource.RLIMIT_AS, (limits["memory_bytes"], limits["memory_bytes"]))


def _drop_privileges(uid, gid, sandboxed):
    if uid >= 0:
        os.setgroups([])
        os.setgid(gid)
        os.setuid(uid)
    if not sandboxed:
        return
    with open("/proc/self/status") as status:
        effective = [line.split()[1] for line in status if line.startswith("CapEff:")]
    if effective and int(effective[0], 16) != 0:
        raise SystemExit(f"teamrl sandbox harness: refusing to run with capabilities {effective[0]}")


def _make_undumpable():
    # Switching uid from root already made us non-dumpable (then /proc/self belongs to root, not
    # to us); otherwise say so explicitly. Non-dumpable (inherited by the server and the judges): no
    # program process can open our descriptors through /proc/<pid>/fd, read our memory, or ptrace us.
    if os.stat("/proc/self").st_uid != os.getuid():
        return
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(_PR_SET_DUMPABLE, 0, 0, 0, 0) != 0:
        raise SystemExit(f"teamrl sandbox harness: prctl(PR_SET_DUMPABLE) failed: errno {ctypes.get_errno()}")


def _emit(fd, obj):
    data = (json.dumps(obj) + "\n").encode()
    while data:
        data = data[os.write(fd, data):]


def _not_run(message):
    return {"passed": False, "error_type": "NotRun", "message": message, "duration_s": 0.0}


def main(argv):
    """Entry point: argv = [RESULT_FD, UID, GID, SANDBOXED] (UID -1: keep the current user).

    SANDBOXED "1" means we run inside bubblewrap: in our own PID namespace, and with no capability
    left once privileges are dropped (checked: the harness refuses to run otherwise).
    """
    result_fd, uid, gid, sandboxed = int(argv[0]), int(argv[1]), int(argv[2]), argv[3] == "1"
    _drop_privileges(uid, gid, sandboxed)
    _make_undumpable()
    if hasattr(sys, "set_int_max_str_digits"):
        sys.set_int_max_str_digits(0)  # a big integer result must cross the boundary like a small one
    server = _Server(result_fd)
    payload = json.loads(sys.stdin.buffer.read().decode())
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.close(null)
    limits = payload["limits"]
    sys.path.extend(path for path in payload["sys_path"] if path not in sys.path)  # started with -S
    settings = {"setup": compile(payload["setup"], "<setup>", "exec"), "relay": payload["relay"],
                "record": payload["record"]}
    tests = [(test if isinstance(test, dict) else compile(test, f"<test {index}>", "exec"), modules)
             for index, (test, modules) in enumerate(zip(payload["tests"], payload["modules"]))]
    _preload(payload["setup"] + "\n" + "\n".join(test for test in payload["tests"] if isinstance(test, str)))
    server.start(payload["code"], limits, payload["sys_path"], payload["relay"])
    del payload
    _emit(result_fd, {"ready": True})
    program_deadline = time.monotonic() + limits["program_timeout_s"]
    program_failure, server_lost = None, False
    for index, test in enumerate(tests):
        if program_failure is not None:
            # Loading the program is the same for every test: its failure is every test's failure.
            outcome = dict(program_failure, duration_s=0.0)
        elif server_lost:
            outcome = _not_run("the program server was killed by an earlier test (the program): "
                               "no program process could be started for this test")
        elif time.monotonic() >= program_deadline:
            outcome = {"passed": False, "error_type": "Timeout", "timed_out": True, "limit": "wall_time",
                       "message": "program time budget of {:.1f} s used up before this test ran".format(
                           limits["program_timeout_s"]), "duration_s": 0.0}
        else:
            deadline = min(time.monotonic() + limits["test_timeout_s"], program_deadline)
            try:
                outcome = run_one(server, test, settings, limits, deadline, sandboxed)
            except ServerLost:
                server_lost = True
                outcome = _not_run("the program server was killed (by the program) before this test ran")
            if not outcome["passed"] and outcome.get("phase") == "program":
                program_failure = {k: v for k, v in outcome.items() if k != "duration_s"}
        outcome["index"] = index
        _emit(result_fd, outcome)
    _emit(result_fd, {"done": True})


if __name__ == "__main__":
    main(sys.argv[1:])
