"""Deadlines: no phase of a step waits forever.

The trainer runs each phase of a step (generation, reward, each worker-group call, weight sync, checkpoint,
validation) inside :func:`phase`, with the seconds ``trainer.phase_timeout_s`` (or ``trainer.phase_timeouts.<kind>``)
allow it. Two things enforce the deadline:

* every wait of a Ray worker group on its ranks (:func:`wait_refs`) waits at most until the phase's deadline, and
  knows which ranks did not answer;
* in the driver's main thread a timer interrupts the thread (a real-time signal) a moment after the deadline, for
  what runs in the driver itself: a reward function that blocks, the ``local`` executor, a wait outside a worker group.

When a deadline passes, every worker's Python stacks (each Ray actor dumps them with :mod:`faulthandler` on
``SIGUSR2``, whatever its main thread is doing; a stopped process is reported as not answering) and the driver's go
to the run's log, the worker groups are marked wedged (they are killed, not asked to close), and
:class:`PhaseTimeoutError` says in one line which phase, role, rank and host did not finish and how long the driver
waited. A worker that died (its process or node lost) ends the wait at once with :class:`WorkerLostError`. The last
checkpoint is never touched by either: a checkpoint is written under a temporary name and renamed into place
(:mod:`polyrl.trainer.checkpoint`), so the run resumes from it. See docs/cluster.md, "Deadlines and restarts".
"""

from __future__ import annotations

import faulthandler
import logging
import os
import signal
import socket
import sys
import tempfile
import threading
import time
import traceback
import weakref
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from polyrl.errors import PolyrlError

log = logging.getLogger("polyrl")

#: The kinds of phase with a deadline of their own (``trainer.phase_timeouts.<kind>``); ``worker_call`` covers every
#: worker-group call of a step outside the others (log-probs, values, updates, memory statistics).
PHASE_KINDS = ("generation", "reward", "worker_call", "weight_sync", "checkpoint", "validation")
#: ``trainer.phase_timeout_s``'s default (generous for real models: a long generation or checkpoint fits).
DEFAULT_PHASE_TIMEOUT_S = 1800.0
#: The signal a Ray worker dumps its Python stacks on (:func:`install_stack_dump`).
STACK_SIGNAL = signal.SIGUSR2
#: Seconds after a deadline the driver's own code is interrupted: a worker-group wait, which names the ranks, ends
#: first.
ALARM_GRACE_S = 2.0
#: What interrupts the driver's main thread past a deadline (a real-time signal nothing else here uses).
DEADLINE_SIGNAL = signal.SIGRTMIN + 5
#: Seconds a worker has to write its stacks once asked.
STACK_WAIT_S = 3.0


class PhaseTimeoutError(PolyrlError, TimeoutError):
    """A phase of a step did not finish within its deadline (``trainer.phase_timeout_s``)."""


class WorkerLostError(PolyrlError, RuntimeError):
    """A worker process (or its whole node) died while the driver waited for it."""

    #: The Ray node id of the lost worker ('' when unknown).
    node_id: str = ""


class _DeadlinePassed(BaseException):
    """Raised inside a phase when its deadline passed; :func:`phase` turns it into :class:`PhaseTimeoutError`.
    A ``BaseException`` so that no ``except Exception`` in a reward function or a manager swallows it."""

    def __init__(self, pending: Sequence[tuple[Any, int]] = ()) -> None:
        super().__init__("deadline passed")
        self.pending = list(pending)
        #: The driver's stacks where the deadline found it (before they unwind).
        self.driver_stacks = _driver_stacks()


@dataclass
class Phase:
    """A phase in progress: its name (``update_actor``), kind (``worker_call``), role and deadline."""

    name: str
    kind: str
    role: str
    seconds: float
    started: float
    #: Set once the phase ended or its timeout is being reported: its timer no longer interrupts anything.
    over: bool = False

    def remaining(self) -> float:
        """Seconds left before the deadline (negative once it passed)."""
        return self.started + self.seconds - time.monotonic()


def phase_seconds(trainer: Any, kind: str) -> float:
    """The deadline of a phase of ``kind``: ``trainer.phase_timeouts.<kind>`` when set, else ``trainer.phase_timeout_s``."""
    per_kind = getattr(getattr(trainer, "phase_timeouts", None), kind, None)
    if per_kind is not None:
        return float(per_kind)
    # a trainer block without the key (a config built by hand) gets the schema's default, never "no time at all"
    return float(getattr(trainer, "phase_timeout_s", None) or DEFAULT_PHASE_TIMEOUT_S)


_state = threading.local()


def _stack() -> list[Phase]:
    if not hasattr(_state, "phases"):
        _state.phases = []
    return _state.phases


def current() -> Phase | None:
    """The innermost phase in progress in this thread (``None``: no deadline)."""
    phases = _stack()
    return phases[-1] if phases else None


def _on_deadline_signal(signum: int, frame: Any) -> None:
    phases = _stack()
    if phases and not phases[-1].over and phases[-1].remaining() <= 0:
        raise _DeadlinePassed()
    # a timer of a phase that just ended, or one whose timeout is being reported: nothing to do


def _fire(phase_: Phase, thread_id: int) -> None:
    """Runs on a timer thread: interrupt the main thread if ``phase_`` is still in progress there."""
    if not phase_.over and phase_.remaining() <= 0:
        signal.pthread_kill(thread_id, DEADLINE_SIGNAL)


@contextmanager
def phase(name: str, seconds: float, *, kind: str = "worker_call", role: str = "") -> Iterator[Phase]:
    """Run the body as phase ``name`` with a deadline of ``seconds``; past it, raise :class:`PhaseTimeoutError`
    (after the stacks of every worker went to the run's log). Phases nest: the innermost one's deadline applies.

    In the main thread a timer thread signals the main thread (``DEADLINE_SIGNAL``, a real-time signal: ``SIGALRM``
    stays free for pytest-timeout and others) ``ALARM_GRACE_S`` after the deadline, which stops code that runs in
    the driver itself (a blocking reward function, the ``local`` executor); a blocking system call returns with
    EINTR and the handler raises."""
    p = Phase(name, kind, role, float(seconds), time.monotonic())
    main = threading.current_thread() is threading.main_thread()
    phases = _stack()
    outermost = not phases
    previous = signal.getsignal(DEADLINE_SIGNAL) if main and outermost else None
    phases.append(p)
    timer = None
    if main:
        if outermost:
            signal.signal(DEADLINE_SIGNAL, _on_deadline_signal)
        timer = threading.Timer(p.seconds + ALARM_GRACE_S, _fire, args=(p, threading.get_ident()))
        timer.daemon = True
        timer.start()
    error: PhaseTimeoutError | None = None
    try:
        yield p
    except _DeadlinePassed as exc:
        if phases and phases[-1] is p:
            p.over = True  # the stacks take seconds to collect: the timer must not interrupt that
            error = _timed_out(p, exc.pending, exc.driver_stacks)
        else:  # an inner phase's: let it through to that phase (cannot happen: inner phases exit first)
            raise
    finally:
        p.over = True
        if timer is not None:
            timer.cancel()
        if phases and phases[-1] is p:
            phases.pop()
        if main and outermost:
            signal.signal(DEADLINE_SIGNAL, previous if previous is not None else signal.SIG_DFL)
    if error is not None:
        raise error  # outside the except block: no Ray error rides along as its context


# ---------------------------------------------------------------------- the ranks' side


def install_stack_dump() -> str:
    """In a worker process: dump every thread's Python stack to a file on ``SIGUSR2`` (:mod:`faulthandler` writes
    it from the signal handler, even while the main thread is inside a collective). Returns the file's path."""
    path = os.path.join(tempfile.gettempdir(), f"polyrl-stacks-{os.getpid()}.txt")
    handle = open(path, "w")  # noqa: SIM115 - kept open for the process's life: faulthandler writes to its fd
    faulthandler.register(STACK_SIGNAL, file=handle, all_threads=True, chain=False)
    _state.stack_file = handle  # never closed while the process lives
    return path


def process_info(stack_file: str) -> dict[str, Any]:
    """Who this process is, for error lines and stack dumps: pid, host name, node address, Ray node id."""
    info: dict[str, Any] = {"pid": os.getpid(), "host": socket.gethostname(), "ip": "", "node_id": "",
                            "stack_file": stack_file}
    try:
        import ray

        info["ip"] = ray.util.get_node_ip_address()
        info["node_id"] = ray.get_runtime_context().get_node_id()
    except Exception:  # outside Ray (a test): the host name says enough
        pass
    return info


def _process_state(pid: int) -> str | None:
    """The kernel's state letter of ``pid`` (``R``, ``S``, ``T`` for stopped...), ``None`` when it is gone."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("State:"):
                    return line.split()[1]
    except OSError:
        return None
    return "?"


def dump_stacks_of(pid: int, stack_file: str, wait_s: float = STACK_WAIT_S) -> tuple[str, str]:
    """Ask process ``pid`` (on this host) for its stacks: ``(status, text)``, status ``answered``, ``stopped``
    (SIGSTOP or a debugger: it cannot answer), ``gone`` or ``silent`` (did not write within ``wait_s``)."""
    state = _process_state(pid)
    if state is None:
        return "gone", ""
    if state in ("T", "t"):
        return "stopped", ""
    try:
        start = os.path.getsize(stack_file)
        os.kill(pid, STACK_SIGNAL)
    except OSError as exc:
        return "gone", str(exc)
    deadline = time.monotonic() + wait_s
    size, stable_since = start, time.monotonic()
    while time.monotonic() < deadline:
        time.sleep(0.05)
        now = os.path.getsize(stack_file)
        if now != size:
            size, stable_since = now, time.monotonic()
        elif size > start and time.monotonic() - stable_since > 0.3:
            break
    if size == start:
        return ("stopped" if _process_state(pid) in ("T", "t") else "silent"), ""
    with open(stack_file, errors="replace") as f:
        f.seek(start)
        return "answered", f.read()


# ---------------------------------------------------------------------- the driver's side

#: Every Ray worker group alive in this process (their workers' stacks are dumped when a deadline passes).
_groups: weakref.WeakSet[Any] = weakref.WeakSet()


def register_group(group: Any) -> None:
    """Remember ``group`` (a :class:`~polyrl.controller.worker_group.RayWorkerGroup` with ``processes``) for dumps."""
    _groups.add(group)


def describe_rank(group: Any, rank: int) -> str:
    """``rank 1 of worker group 'colocated' (pid 123 on host h, 10.0.0.2)``."""
    info = (getattr(group, "processes", None) or [{}] * (rank + 1))[rank] if rank >= 0 else {}
    where = " on ".join(x for x in (f"pid {info['pid']}" if info.get("pid") else "",
                                    f"host {info['host']}" if info.get("host") else "") if x)
    where += f", {info['ip']}" if info.get("ip") else ""
    return f"rank {rank} of worker group '{getattr(group, 'name', '?')}'" + (f" ({where})" if where else "")


def _collect_group_stacks(group: Any, wait_s: float) -> list[tuple[int, str, str]]:
    """``(rank, status, stacks)`` of every rank of ``group``: asked on the driver's host directly, elsewhere by a
    small Ray task on the rank's node (a node that does not answer is ``silent``)."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    here = ray.get_runtime_context().get_node_id() if ray.is_initialized() else ""
    out: list[tuple[int, str, str]] = []
    remote: list[tuple[int, Any]] = []
    for rank, info in enumerate(getattr(group, "processes", []) or []):
        if not info.get("pid"):
            out.append((rank, "unknown", ""))
        elif not info.get("node_id") or info["node_id"] == here:
            out.append((rank, *dump_stacks_of(int(info["pid"]), info["stack_file"], wait_s)))
        else:
            task: Any = ray.remote(dump_stacks_of).options(
                num_cpus=0, scheduling_strategy=NodeAffinitySchedulingStrategy(info["node_id"], soft=False))
            remote.append((rank, task.remote(int(info["pid"]), info["stack_file"], wait_s)))
    for rank, ref in remote:
        try:
            status, text = ray.get(ref, timeout=wait_s + 20)
        except Exception:  # the node is gone or does not run tasks
            ray.cancel(ref, force=True)
            status, text = "silent", ""
        out.append((rank, status, text))
    return sorted(out)


def _driver_stacks() -> str:
    frames = sys._current_frames()
    parts = []
    for thread in threading.enumerate():
        frame = frames.get(thread.ident or -1)
        if frame is not None:
            parts.append(f"Thread {thread.name} (driver):\n" + "".join(traceback.format_stack(frame)))
    return "\n".join(parts)


_STATUS_WORDS = {"stopped": "is stopped (SIGSTOP or a debugger) and did not answer",
                 "gone": "is gone (its process exited)", "silent": "did not answer",
                 "unknown": "was not asked (no process id)", "answered": "was still running"}


def collect_stacks(wait_s: float = STACK_WAIT_S, driver: str | None = None) -> tuple[str, dict[tuple[int, int], str]]:
    """Every live worker group's ranks' stacks and the driver's (``driver``: taken earlier), as one text for the
    run's log, and each rank's status by ``(id(group), rank)``."""
    driver = driver if driver is not None else _driver_stacks()
    sections = [f"==== driver (pid {os.getpid()} on host {socket.gethostname()})\n{driver}"]
    status: dict[tuple[int, int], str] = {}
    for group in list(_groups):
        try:
            ranks = _collect_group_stacks(group, wait_s)
        except Exception as exc:  # a dump never hides the timeout itself
            sections.append(f"==== worker group '{getattr(group, 'name', '?')}': stacks not collected ({exc})")
            continue
        for rank, state, text in ranks:
            status[(id(group), rank)] = state
            head = f"==== {describe_rank(group, rank)}: {_STATUS_WORDS.get(state, state)}"
            sections.append(head + ("\n" + text.strip() if text.strip() else ""))
    return "\n".join(sections), status


def _timed_out(p: Phase, pending: Sequence[tuple[Any, int]], driver: str) -> PhaseTimeoutError:
    """Dump every stack to the run's log, mark the groups wedged and build the one-line error."""
    waited = time.monotonic() - p.started
    try:
        text, status = collect_stacks(driver=driver)
    except Exception as exc:  # never let the dump hide the timeout
        text, status = f"stacks not collected: {exc}", {}
    log.debug("phase '%s' passed its deadline of %.0f s; Python stacks of the driver and every worker:\n%s",
              p.name, p.seconds, text)
    for group in list(_groups):
        group.wedged = True
    role = f" (role {p.role})" if p.role else ""
    if pending:
        who = "; ".join(f"{describe_rank(g, r)} {_STATUS_WORDS.get(status.get((id(g), r), ''), 'did not answer')}"
                        for g, r in pending)
    else:
        who = f"the driver (pid {os.getpid()} on host {socket.gethostname()}) was still inside it"
    from polyrl.logs import run_log_file

    where = run_log_file()
    return PhaseTimeoutError(
        f"phase '{p.name}'{role} did not finish within its deadline: waited {waited:.1f} s "
        f"(trainer.phase_timeout_s / trainer.phase_timeouts.{p.kind} = {p.seconds:g}): {who}. Every worker's Python "
        f"stacks are in {where or 'the run log'}; the last checkpoint is whole: run again to resume")


#: Seconds the other ranks have to fail too once one failed (the error raised is the lowest rank's among them).
FAIL_GRACE_S = 2.0
#: Seconds a failure that says a peer went away waits for Ray to report the lost worker it comes from.
LOST_GRACE_S = 10.0
#: Seconds a worker's node has to run a small task before the worker counts as lost (:func:`find_lost_worker`).
PROBE_S = 15.0
#: Words of a collective's (gloo, NCCL, a TCP store's) error when the process at the other end went away.
PEER_GONE_WORDS = ("by peer", "connection reset", "connection closed", "broken pipe", "remote process exited",
                   "socket closed")


def _peer_gone(exc: BaseException) -> bool:
    text = str(exc).lower()
    return any(word in text for word in PEER_GONE_WORDS)


def _is_lost(exc: BaseException) -> bool:
    """Ray's error for an actor that died or is unreachable (not one whose constructor failed: that is its own
    error)."""
    import ray

    return isinstance(exc, ray.exceptions.RayActorError) and not getattr(exc, "actor_init_failed", False)


def wait_refs(refs: list[Any], owners: Sequence[tuple[Any, int]] = ()) -> list[Any]:
    """``ray.get(refs)`` that returns soon after one of them failed (a rank whose peer died may wait for it until the
    rendezvous times out) and waits no longer than the current phase's deadline.

    ``owners[i]``: the ``(group, rank)`` of ``refs[i]``; with them, a rank whose process died, or one whose failure
    says a peer went away while some rank of this run's groups is lost (:func:`find_lost_worker`), raises
    :class:`WorkerLostError` naming the lost one. Without them (a group's constructors: a constructor that failed
    is an error of its own) and otherwise, the error raised is the lowest rank's among those that failed within
    ``FAIL_GRACE_S`` of the first."""
    import ray

    p = current()
    pending = list(refs)
    while pending:
        timeout = None if p is None else max(0.0, p.remaining())
        done, pending = ray.wait(pending, num_returns=1, timeout=timeout)
        if not done:
            raise _DeadlinePassed([owners[refs.index(r)] for r in pending] if owners else [])
        try:
            ray.get(done)
        except Exception as exc:
            first: BaseException = exc
        else:
            continue
        raise _failure(refs, owners, first, p) from None  # not Ray's error as context: the CLI prints this line
    return ray.get(refs)


def _failure(refs: list[Any], owners: Sequence[tuple[Any, int]], first: BaseException,
             p: Phase | None) -> BaseException:
    """What :func:`wait_refs` raises once ``first`` failed: a lost worker where there is one, else the lowest
    rank's error among the ranks that failed within the grace."""
    import ray

    peer_gone = bool(owners) and not _is_lost(first) and _peer_gone(first)
    grace = LOST_GRACE_S if peer_gone else FAIL_GRACE_S
    if p is not None:
        grace = min(grace, max(0.0, p.remaining()))
    deadline = time.monotonic() + grace
    while True:
        ready, pending = ray.wait(refs, num_returns=len(refs), timeout=0)
        errors: dict[int, BaseException] = {}
        for i, ref in enumerate(refs):
            if ref in ready:
                try:
                    ray.get(ref)
                except Exception as exc:
                    errors[i] = exc
        lost = [i for i, exc in sorted(errors.items()) if _is_lost(exc)]
        if owners and lost:
            return _lost(p, owners[lost[0]])
        left = deadline - time.monotonic()
        if not pending or left <= 0:
            break
        ray.wait(pending, num_returns=1, timeout=left)
    if peer_gone:  # a collective's peer went away, and Ray did not say it is one of these ranks
        found = find_lost_worker(p, min(PROBE_S, max(1.0, p.remaining())) if p is not None else PROBE_S)
        if found is not None:
            return found
    return errors[min(errors)] if errors else first


def find_lost_worker(p: Phase | None, probe_s: float = PROBE_S) -> WorkerLostError | None:
    """The :class:`WorkerLostError` of the first rank of this driver's worker groups whose process is gone (on this
    node: looked up in ``/proc``; elsewhere by a small task on its node) or whose node does not run that task within
    ``probe_s``; ``None`` when every rank is there. Asked when a collective says a peer went away: the peer may be in
    another group (the rollout's end of a weight transfer) and Ray may not know yet (a node that died is listed as
    alive until its health checks fail)."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    here = ray.get_runtime_context().get_node_id()
    remote: list[tuple[tuple[Any, int], Any]] = []
    for group in list(_groups):
        for rank, info in enumerate(getattr(group, "processes", None) or []):
            if not info.get("pid"):
                continue
            if not info.get("node_id") or info["node_id"] == here:
                if _process_state(int(info["pid"])) is None:
                    return _lost(p, (group, rank))
                continue
            task: Any = ray.remote(_process_state).options(
                num_cpus=0, scheduling_strategy=NodeAffinitySchedulingStrategy(info["node_id"], soft=False))
            remote.append(((group, rank), task.remote(int(info["pid"]))))
    deadline = time.monotonic() + probe_s
    for owner, ref in remote:
        try:
            state = ray.get(ref, timeout=max(0.0, deadline - time.monotonic()))
        except Exception:  # the node is gone, or does not run tasks
            try:
                ray.cancel(ref, force=True)
            except Exception:
                pass
            return _lost(p, owner)
        if state is None:
            return _lost(p, owner)
    return None


def lost_worker_in(exc: BaseException) -> WorkerLostError | None:
    """The :class:`WorkerLostError` naming the rank (and node) of a Ray actor that died or became unreachable
    when ``exc`` is, or was caused by, Ray's actor error for one of this driver's worker groups (a call that did not
    go through :func:`wait_refs`: a rollout call, a weight sync's thread); None otherwise. An actor that failed in
    its constructor is not lost: that is an error of its own."""
    import sys

    ray_errors = sys.modules.get("ray.exceptions")  # no Ray imported: no Ray error to look for
    seen: set[int] = set()
    error: BaseException | None = exc
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        if isinstance(error, WorkerLostError):
            return error
        if ray_errors is not None and _is_lost(error):
            actor = getattr(error, "actor_id", None)
            for group in list(_groups):
                for rank, worker in enumerate(getattr(group, "workers", None) or []):
                    try:
                        if actor and worker._actor_id.hex() == actor:
                            return _lost(current(), (group, rank))
                    except AttributeError:
                        continue
            lost = WorkerLostError(f"a worker of this run was lost ({error}). The last checkpoint is whole: run "
                                   "again to resume, or set trainer.max_restarts to resume by itself")
            return lost
        error = error.__cause__ or error.__context__
    return None


def _lost(p: Phase | None, owner: tuple[Any, int]) -> WorkerLostError:
    group, rank = owner
    group.wedged = True
    info = (getattr(group, "processes", None) or [{}] * (rank + 1))[rank]
    node = f"node {info.get('ip') or info.get('host') or '?'}"
    try:
        import ray

        alive = {n["NodeID"] for n in ray.nodes() if n.get("Alive")}
        if info.get("node_id") and info["node_id"] not in alive:
            node += " (the whole node left the cluster)"
    except Exception:
        pass
    during = f" during phase '{p.name}'" + (f" (role {p.role})" if p.role else "") if p is not None else ""
    error = WorkerLostError(
        f"{describe_rank(group, rank)} on {node} was lost{during}: its process died. The last checkpoint is whole: "
        "run again to resume, or set trainer.max_restarts to resume by itself")
    error.node_id = str(info.get("node_id") or "")
    return error


__all__ = ["PHASE_KINDS", "Phase", "PhaseTimeoutError", "WorkerLostError", "collect_stacks",
           "current", "describe_rank", "dump_stacks_of", "find_lost_worker", "install_stack_dump", "lost_worker_in", "phase", "phase_seconds",
           "process_info", "register_group", "wait_refs"]
