"""The ``code`` reward: a response's program run against its row's tests in a sandbox (verl's ``prime_code`` and
``sandbox_fusion`` scorers; docs/reward_models.md, "Code rewards").

The program is the last fenced code block of the response (````` ```python ... ``` `````, else the last
````` ``` ... ``` `````, else the whole response, ``<think>...</think>`` removed). The row's ground truth (a dict or
its JSON text) holds the tests, in one of three styles:

* **standard input / output** (APPS, CodeContests, TACO as verl's ``prime_code`` data has them):
  ``{"inputs": ["1 2\\n", ...], "outputs": ["3\\n", ...]}``: the program reads each input and must print the output
  (compared line by line with trailing whitespace dropped; tokens that are numbers may differ by 1e-6);
* **function call**: ``{"fn_name": "add", "inputs": [[1, 2], ...], "outputs": [3, ...]}``: ``add(*inputs[i])`` (a
  function, or a method of ``class Solution``) must return ``outputs[i]`` (or ``outputs[i][0]``, APPS' wrapping);
* **asserts**: ``{"asserts": ["assert add(1, 2) == 3", ...], "setup": "import math"}`` (or a plain list of assert
  statements): each assert, run after the program, must pass.

Each test runs alone, in a fresh sandboxed process, for at most ``reward.code.timeout_s`` seconds. The score
is 1 when every test passes and 0 otherwise, or with ``reward.code.partial_credit`` the fraction passed; the
result also holds ``acc`` (all passed), ``passed``, ``total``, ``timeouts`` and ``errors``. At most
``reward.num_workers`` programs run at a time (the reward manager's calls share the slots; on a SandboxFusion server
also no more than ``reward.sandbox_fusion.max_concurrent``). A test the sandbox
could not run at all (``sandbox_error``: a server that fails) makes the call raise :class:`SandboxUnavailable`,
so the sample gets ``reward.fallback_score`` and counts in ``reward/failures`` instead of scoring 0.
"""

from __future__ import annotations

import json
import math
import re
import threading
from dataclasses import dataclass
from typing import Any

from polyrl.errors import ConfigError

_FENCE_PY = re.compile(r"```(?:python|py|python3)[ \t]*\n(.*?)```", re.DOTALL | re.IGNORECASE)
_FENCE = re.compile(r"```[^\n`]*\n(.*?)```", re.DOTALL)
_THINK = re.compile(r"<think>.*?</think>", re.DOTALL | re.IGNORECASE)


class SandboxUnavailable(RuntimeError):
    """The sandbox could not run a test (the program is not to blame): the sample gets the fallback score."""


def extract_code(response: str) -> str:
    """The program of a response: its last ```python block, else its last fenced block, else the whole text."""
    text = _THINK.sub("", response)
    for pattern in (_FENCE_PY, _FENCE):
        found = pattern.findall(text)
        if found:
            return str(found[-1])
    return text


@dataclass(frozen=True)
class CodeTests:
    """The tests of one row: ``style`` (``stdio``, ``call``, ``assert``) and its cases."""

    style: str
    inputs: tuple[Any, ...] = ()
    outputs: tuple[Any, ...] = ()
    fn_name: str = ""
    asserts: tuple[str, ...] = ()
    setup: str = ""

    def __len__(self) -> int:
        return len(self.asserts) if self.style == "assert" else len(self.inputs)


def parse_tests(ground_truth: Any) -> CodeTests:
    """The tests a row's ground truth holds (see the module docstring); ``ValueError`` says what is wrong."""
    data = ground_truth
    if isinstance(data, str):
        try:
            data = json.loads(data)
        except json.JSONDecodeError as exc:
            raise ValueError(f"the ground truth is not JSON tests: {exc}") from None
    if isinstance(data, list) and all(isinstance(a, str) for a in data):
        return CodeTests("assert", asserts=tuple(data))
    if not isinstance(data, dict):
        raise ValueError(f"the ground truth holds no tests (a {type(data).__name__})")
    if "asserts" in data:
        asserts = data["asserts"]
        if isinstance(asserts, str):
            asserts = [asserts]
        return CodeTests("assert", asserts=tuple(str(a) for a in asserts), setup=str(data.get("setup") or ""))
    if "inputs" not in data or "outputs" not in data:
        raise ValueError("the tests need 'inputs' and 'outputs' (or 'asserts')")
    inputs, outputs = list(data["inputs"]), list(data["outputs"])
    if len(inputs) != len(outputs):
        raise ValueError(f"{len(inputs)} test inputs but {len(outputs)} outputs")
    if data.get("fn_name"):
        return CodeTests("call", tuple(inputs), tuple(outputs), fn_name=str(data["fn_name"]))
    return CodeTests("stdio", tuple(inputs), tuple(outputs))


_CALL_HARNESS = """

def _polyrl_same(got, want):
    if isinstance(got, tuple):
        got = list(got)
    if isinstance(want, tuple):
        want = list(want)
    if isinstance(got, bool) or isinstance(want, bool):
        return got == want
    if isinstance(got, (int, float)) and isinstance(want, (int, float)):
        return abs(got - want) <= 1e-6 * max(1.0, abs(want))
    if isinstance(got, list) and isinstance(want, list):
        return len(got) == len(want) and all(_polyrl_same(a, b) for a, b in zip(got, want))
    if isinstance(got, dict) and isinstance(want, dict):
        return got.keys() == want.keys() and all(_polyrl_same(got[k], want[k]) for k in got)
    return got == want


def _polyrl_check():
    import json
    args = json.loads({args!r})
    want = json.loads({want!r})
    fn = globals().get({name!r})
    if fn is None and "Solution" in globals():
        fn = getattr(globals()["Solution"](), {name!r}, None)
    if fn is None:
        raise SystemExit("no function named " + {name!r})
    got = fn(*args) if isinstance(args, list) else fn(args)
    if not (_polyrl_same(got, want) or (isinstance(want, list) and len(want) == 1 and _polyrl_same(got, want[0]))):
        raise SystemExit("wrong answer: " + repr(got)[:200] + " != " + repr(want)[:200])


_polyrl_check()
"""


def _number(token: str) -> float | None:
    try:
        value = float(token)
    except ValueError:
        return None
    return value if math.isfinite(value) else None


def same_output(got: str, want: Any) -> bool:
    """Whether a program's standard output matches the expected one: line by line with trailing whitespace (and
    trailing empty lines) dropped, then token by token with numbers equal within 1e-6."""
    want_text = "\n".join(str(w) for w in want) if isinstance(want, list) else str(want)
    got_lines = [line.rstrip() for line in got.strip("\n").splitlines()]
    want_lines = [line.rstrip() for line in want_text.strip("\n").splitlines()]
    while got_lines and not got_lines[-1]:
        got_lines.pop()
    while want_lines and not want_lines[-1]:
        want_lines.pop()
    if got_lines == want_lines:
        return True
    got_tokens, want_tokens = " ".join(got_lines).split(), " ".join(want_lines).split()
    if len(got_tokens) != len(want_tokens):
        return False
    for a, b in zip(got_tokens, want_tokens):
        if a == b:
            continue
        x, y = _number(a), _number(b)
        if x is None or y is None or abs(x - y) > 1e-6 * max(1.0, abs(y)):
            return False
    return True


class CodeScorer:
    """``compute_score`` for code: runs a response's program against its row's tests in ``sandbox`` (a
    :class:`polyrl.sandboxes.CodeSandbox`), ``slots`` programs at a time at most."""

    def __init__(self, sandbox: Any, config: Any, *, slots: int = 4) -> None:
        self.sandbox = sandbox
        self.timeout_s = float(getattr(config, "timeout_s", 5.0))
        self.memory_mb = int(getattr(config, "memory_mb", 1024))
        self.partial_credit = bool(getattr(config, "partial_credit", False))
        self.max_tests = int(getattr(config, "max_tests", 0))
        self.language = str(getattr(config, "language", "python"))
        self.slots = threading.BoundedSemaphore(max(1, int(slots)))
        #: The most programs that ran at once (for tests and tuning).
        self.peak_concurrency = 0
        self._running = 0
        self._lock = threading.Lock()

    def _run(self, code: str, stdin: str = "") -> Any:
        with self.slots:
            with self._lock:
                self._running += 1
                self.peak_concurrency = max(self.peak_concurrency, self._running)
            try:
                result = self.sandbox.run(code, stdin=stdin, timeout_s=self.timeout_s, language=self.language,
                                          memory_mb=self.memory_mb)
            finally:
                with self._lock:
                    self._running -= 1
        if result.status == "sandbox_error":
            raise SandboxUnavailable(f"sandbox '{getattr(self.sandbox, 'name', '?')}' could not run a test: "
                                     f"{result.detail}")
        return result

    def _passes(self, program: str, tests: CodeTests, i: int) -> tuple[bool, str]:
        """Whether test ``i`` passes, and the run's status."""
        if tests.style == "stdio":
            stdin = tests.inputs[i]
            result = self._run(program, "\n".join(map(str, stdin)) if isinstance(stdin, list) else str(stdin))
            return result.ok and same_output(result.stdout, tests.outputs[i]), result.status
        if tests.style == "call":
            harness = _CALL_HARNESS.format(args=json.dumps(tests.inputs[i]), want=json.dumps(tests.outputs[i]),
                                           name=tests.fn_name)
            result = self._run(program + "\n" + harness)
            return result.ok, result.status
        setup = tests.setup + "\n" if tests.setup else ""
        result = self._run(setup + program + "\n\n" + tests.asserts[i] + "\n")
        return result.ok, result.status

    def __call__(self, data_source: str, solution_str: str, ground_truth: Any, extra_info: Any = None) -> dict:
        """Run the tests; see the module docstring for the result's keys."""
        tests = parse_tests(ground_truth)
        program = extract_code(solution_str)
        total = len(tests) if not self.max_tests else min(len(tests), self.max_tests)
        passed = timeouts = errors = 0
        for i in range(total):
            ok, status = self._passes(program, tests, i)
            passed += ok
            timeouts += status == "timeout"
            errors += status in ("error", "compile_error")
            if not ok and not self.partial_credit:
                break  # the score is 0 whatever the rest do
        all_passed = total > 0 and passed == total
        score = (passed / total if total else 0.0) if self.partial_credit else float(all_passed)
        return {"score": float(score), "acc": float(all_passed), "passed": passed, "total": total,
                "timeouts": timeouts, "errors": errors}


# ---------------------------------------------------------------------- the run's scorer

_ACTIVE: CodeScorer | None = None
_BY_URL: dict[str, CodeScorer] = {}
_LOCK = threading.Lock()


def sandbox_kind(reward: Any) -> str:
    """``reward.sandbox`` with ``auto`` resolved: ``sandbox_fusion`` when ``reward.sandbox_fusion.url`` is set."""
    kind = str(getattr(reward, "sandbox", "auto") or "auto")
    if kind == "auto":
        url = getattr(getattr(reward, "sandbox_fusion", None), "url", "")
        return "sandbox_fusion" if url else "local"
    return kind


def build_code_scorer(reward: Any, plugins: Any = None) -> CodeScorer:
    """The code scorer of a ``reward`` config block: the sandbox ``reward.sandbox`` names (from the registry),
    ``reward.code``'s limits, :func:`code_slots` slots."""
    from polyrl.plugins import get_plugin_manager

    pm = plugins or get_plugin_manager()
    kind = sandbox_kind(reward)
    try:
        factory = pm.get("sandbox", kind)
    except LookupError as exc:
        raise ConfigError(f"reward.sandbox: {exc}") from None
    return CodeScorer(factory(reward), getattr(reward, "code", None), slots=code_slots(reward, kind))


def code_slots(reward: Any, kind: str) -> int:
    """How many programs run at once: ``reward.num_workers``, and on a SandboxFusion server no more than
    ``reward.sandbox_fusion.max_concurrent`` when that is set (verl's key)."""
    slots = max(1, int(getattr(reward, "num_workers", 4)))
    cap = int(getattr(getattr(reward, "sandbox_fusion", None), "max_concurrent", 0) or 0)
    return min(slots, cap) if kind == "sandbox_fusion" and cap > 0 else slots


def uses_code_rewards(reward: Any, data_sources: Any) -> bool:
    """Whether a run with this ``reward`` block and these data sources scores with the ``code`` reward."""
    from polyrl.rewards.scoring import load_compute_score, reward_function_for, reward_function_spec

    if reward_function_spec(reward):
        try:
            return load_compute_score(reward) is code_score
        except ConfigError:
            return False
    for source in set(data_sources):
        try:
            if reward_function_for(str(source)) is code_score:
                return True
        except NotImplementedError:
            continue
    return False


def configure_code_rewards(reward: Any, plugins: Any = None, *, check: bool = False) -> CodeScorer:
    """Make ``code``'s scorer the one of ``reward`` (the run's ``reward`` block) and, with ``check``, check its
    sandbox now (one line at start-up: an unreachable SandboxFusion URL, no isolation on this machine)."""
    global _ACTIVE
    scorer = build_code_scorer(reward, plugins)
    if check:
        scorer.sandbox.check()
    with _LOCK:
        _ACTIVE = scorer
    return scorer


def _scorer_for(sandbox_fusion_url: str | None) -> CodeScorer:
    global _ACTIVE
    if sandbox_fusion_url:  # verl's keyword: that server, whatever the run configured
        with _LOCK:
            if sandbox_fusion_url not in _BY_URL:
                from polyrl.rewards.config import RewardConfig

                reward = RewardConfig()
                reward.sandbox = "sandbox_fusion"
                reward.sandbox_fusion.url = sandbox_fusion_url
                _BY_URL[sandbox_fusion_url] = build_code_scorer(reward)
            return _BY_URL[sandbox_fusion_url]
    with _LOCK:
        if _ACTIVE is None:
            from polyrl.rewards.config import RewardConfig

            _ACTIVE = build_code_scorer(RewardConfig())
        return _ACTIVE


def code_score(data_source: str, solution_str: str, ground_truth: Any, extra_info: dict | None = None, *,
               sandbox_fusion_url: str | None = None, **kwargs: Any) -> dict:
    """The registered ``code`` reward function (verl's signature): the response's program against the row's tests,
    in the run's sandbox (:func:`configure_code_rewards`), or on the SandboxFusion server ``sandbox_fusion_url``."""
    return _scorer_for(sandbox_fusion_url)(data_source, solution_str, ground_truth, extra_info)
