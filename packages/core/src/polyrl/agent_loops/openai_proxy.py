"""The local OpenAI-compatible endpoint of the ``openai_agent`` loop: chat completions served by the run's
rollout, recorded token for token per trajectory.

One :class:`ProxyServer` per process (started on first use, bound to ``127.0.0.1`` on a free port, reused by
every later trajectory). Each trajectory registers a :class:`Trajectory` under a fresh random key, which the
agent program sends as its API key (``Authorization: Bearer <key>``); a request with another key is refused
(401), so concurrent trajectories never see each other's calls. A request is answered from the HTTP server's
thread: its sampling runs on the trajectory's event loop (the agent loop's), through the same ``agenerate``
client every agent loop gets.

Token exactness: a request whose messages extend an earlier call of the same trajectory (the earlier call's
messages, then the assistant message this endpoint returned for it, then new messages) continues from the
token ids that call was given and sampled; only the new messages are tokenized
(:meth:`polyrl.agent_loops.tool_messages.ToolTurnRenderer.delta_ids`, their content as data). A request that
does not extend any earlier call (or adds an assistant message the model did not write) is rendered afresh with
the chat template and starts a new chain; when it shares its first message with an earlier call (the program
edited or dropped part of the history) it is counted in ``history_edits``.
"""

from __future__ import annotations

import asyncio
import json
import logging
import secrets
import string
import threading
import time
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from polyrl.protocols import GenerationRequest, SamplingParams

logger = logging.getLogger("polyrl")

__all__ = ["Call", "ProxyServer", "RequestError", "Trajectory", "get_proxy"]

#: Largest request body accepted (bytes).
MAX_BODY_BYTES = 8 << 20
#: Request fields refused with 400 (set to anything but null/false): the endpoint cannot honour them.
UNSUPPORTED = ("logprobs", "top_logprobs", "response_format", "logit_bias", "functions", "function_call", "audio",
               "modalities", "prediction", "web_search_options", "echo", "best_of", "suffix")
_ID_CHARS = string.ascii_letters + string.digits


class RequestError(Exception):
    """A request the endpoint refuses: HTTP status, OpenAI-style message, the parameter at fault."""

    def __init__(self, message: str, status: int = 400, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.param, self.code = status, param, code


@dataclass
class Call:
    """One sampled choice of a chat completion, as token ids.

    ``prompt_ids`` is what the model was given (for a continuation: the parent's prompt and response, then
    ``delta_ids``, the new messages' tokens); ``response_ids`` / ``log_probs`` what it sampled (cut after a
    stop string). ``history`` is the request's messages plus the assistant message returned (normalized, see
    :func:`normalize`), which a later request must start with to continue this call.
    """

    index: int
    prompt_ids: list[int]
    response_ids: list[int]
    log_probs: list[float]
    finish_reason: str
    parent: int | None
    delta_ids: list[int]
    history: list[dict]
    tools_key: str
    tool_calls: int = 0
    parse_errors: int = 0


@dataclass
class Trajectory:
    """What one agent program did through the endpoint: its calls and counters."""

    key: str
    loop: asyncio.AbstractEventLoop
    client: Any
    tokenizer: Any
    renderer: Any
    parser: Any
    sampling_params: SamplingParams
    budget: int
    max_prompt_length: int | None
    max_calls: int
    deadline: float
    uid: str = ""
    #: each call is a sample of its own: every prompt within ``max_prompt_length``, every call's budget ``budget``
    per_call: bool = False
    calls: list[Call] = field(default_factory=list)
    counters: dict[str, float] = field(default_factory=lambda: {
        "bad_requests": 0.0, "history_edits": 0.0, "new_chains": 0.0, "budget_refusals": 0.0})
    lock: threading.Lock = field(default_factory=threading.Lock)
    closed: bool = False
    #: the first refused request's reason (for the loop's log line)
    first_error: str | None = None

    # -------------------------------------------------------------- the prompt of a request
    def prompt_for(self, messages: list[dict], tools: list[dict] | None) -> tuple[list[int], int | None, list[int]]:
        """``(prompt_ids, parent call index or None, delta_ids)`` for a request (see the module docstring)."""
        norm = [normalize(m) for m in messages]
        tools_key = json.dumps(tools or [], sort_keys=True)
        with self.lock:
            best: Call | None = None
            for call in self.calls:
                h = call.history
                # continuing: the call's history, then new messages none of which puts words in the model's mouth
                if call.tools_key == tools_key and len(norm) > len(h) and norm[: len(h)] == h \
                        and all(m["role"] != "assistant" for m in norm[len(h):]) \
                        and (best is None or len(h) > len(best.history)):
                    best = call
            shares_start = any(c.history and norm[:1] == c.history[:1] for c in self.calls)
        if best is not None:
            delta = [_render_form(m) for m in messages[len(best.history):]]
            stop_ids = set(self.sampling_params.stop_token_ids)
            eos = getattr(self.tokenizer, "eos_token_id", None)
            if eos is not None:
                stop_ids.add(eos)
            ids = best.response_ids
            sampled_end: list[str] = []
            if ids and ids[-1] in stop_ids and best.finish_reason == "stop":
                sampled_end = [self.tokenizer.decode([ids[-1]])]
                sampled_end += [self.tokenizer.decode([t]) for t in sorted(stop_ids - {ids[-1]})]
            try:
                delta_ids = self.renderer.delta_ids(delta, sampled_end)
            except Exception as exc:  # a template that cannot render these messages after an assistant turn
                raise RequestError(f"the chat template cannot render these messages after the assistant turn: "
                                   f"{type(exc).__name__}: {exc}", param="messages") from None
            return list(best.prompt_ids) + list(best.response_ids) + delta_ids, best.index, delta_ids
        if self.calls:
            with self.lock:
                self.counters["history_edits" if shares_start else "new_chains"] += 1.0
        try:
            ids = self.tokenizer.apply_chat_template([_render_form(m) for m in messages], tools=tools or None,
                                                     add_generation_prompt=True, tokenize=True)
        except Exception as exc:
            raise RequestError(f"the chat template cannot render these messages: {type(exc).__name__}: {exc}",
                               param="messages") from None
        if isinstance(ids, dict) or hasattr(ids, "input_ids"):
            ids = ids["input_ids"]
        return list(ids), None, []

    def root_length(self, parent: int | None) -> int:
        """Prompt length of the chain's first call (what the response budget counts from)."""
        with self.lock:
            while parent is not None:
                call = self.calls[parent]
                if call.parent is None:
                    return len(call.prompt_ids)
                parent = call.parent
        return -1

    def record(self, **kwargs: Any) -> Call:
        with self.lock:
            call = Call(index=len(self.calls), **kwargs)
            self.calls.append(call)
            return call

    def count(self, name: str, reason: str | None = None) -> None:
        with self.lock:
            self.counters[name] = self.counters.get(name, 0.0) + 1.0
            if reason and self.first_error is None:
                self.first_error = reason


def normalize(message: Any) -> dict:
    """The parts of a message that decide what the model saw: role, text, tool calls (name and decoded
    arguments; ids left out), a tool message's call id and a name. Raises :class:`RequestError` for a
    message that is not one."""
    if not isinstance(message, Mapping) or not isinstance(message.get("role"), str):
        raise RequestError("each message must be an object with a 'role'", param="messages")
    role = message["role"]
    if role not in ("system", "developer", "user", "assistant", "tool"):
        raise RequestError(f"message role '{role}' is not supported (system, developer, user, assistant, tool)",
                           param="messages")
    out: dict[str, Any] = {"role": role, "content": _text(message.get("content"))}
    calls = message.get("tool_calls")
    if calls:
        if role != "assistant" or not isinstance(calls, list):
            raise RequestError("'tool_calls' must be a list on an assistant message", param="messages")
        out["tool_calls"] = [_norm_call(c) for c in calls]
    if role == "tool":
        out["tool_call_id"] = message.get("tool_call_id")
    if isinstance(message.get("name"), str):
        out["name"] = message["name"]
    return out


def _text(content: Any) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for p in content:
            if not isinstance(p, Mapping) or p.get("type", "text") != "text" or not isinstance(p.get("text"), str):
                kind = p.get("type") if isinstance(p, Mapping) else type(p).__name__
                raise RequestError(f"content part of type '{kind}' is not supported (text only)", param="messages")
            parts.append(p["text"])
        return "".join(parts)
    raise RequestError("a message's 'content' must be a string, a list of text parts or null", param="messages")


def _norm_call(call: Any) -> list[Any]:
    fn = call.get("function") if isinstance(call, Mapping) else None
    if not isinstance(fn, Mapping) or not isinstance(fn.get("name"), str):
        raise RequestError("each tool call needs a 'function' with a 'name'", param="messages")
    args = fn.get("arguments")
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except ValueError:
            pass
    return [fn["name"], args]


def _render_form(message: Mapping[str, Any]) -> dict:
    """A message as the chat template gets it: text content, tool calls with decoded arguments."""
    out: dict[str, Any] = {"role": "system" if message["role"] == "developer" else message["role"],
                           "content": _text(message.get("content"))}
    if message.get("tool_calls"):
        calls = []
        for c in message["tool_calls"]:
            name, args = _norm_call(c)
            calls.append({"id": c.get("id"), "type": "function", "function": {"name": name, "arguments": args}})
        out["tool_calls"] = calls
    for key in ("tool_call_id", "name"):
        if isinstance(message.get(key), str):
            out[key] = message[key]
    return out


# ---------------------------------------------------------------------- request handling

def _check_body(body: Any) -> dict[str, Any]:
    if not isinstance(body, dict):
        raise RequestError("the request body must be a JSON object")
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise RequestError("'messages' must be a non-empty list", param="messages")
    for key in UNSUPPORTED:
        if body.get(key) not in (None, False):
            raise RequestError(f"'{key}' is not supported by polyrl's openai_agent endpoint", param=key)
    tools = body.get("tools")
    if tools is not None and (not isinstance(tools, list) or not all(
            isinstance(t, Mapping) and t.get("type") == "function" and isinstance(t.get("function"), Mapping)
            and isinstance(t["function"].get("name"), str) for t in tools)):
        raise RequestError("'tools' must be a list of {type: function, function: {name, ...}}", param="tools")
    choice = body.get("tool_choice")
    if choice not in (None, "auto", "none"):
        raise RequestError("'tool_choice' other than 'auto' or 'none' is not supported (the model is sampled as is)",
                           param="tool_choice")
    max_tokens = body.get("max_completion_tokens", body.get("max_tokens"))
    if max_tokens is not None and (not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or max_tokens < 1):
        raise RequestError("'max_tokens' must be a positive integer", param="max_tokens")
    n = body.get("n", 1)
    if n is None:
        n = 1
    if not isinstance(n, int) or isinstance(n, bool) or not 1 <= n <= 16:
        raise RequestError("'n' must be an integer from 1 to 16", param="n")
    stop = body.get("stop") or []
    if isinstance(stop, str):
        stop = [stop]
    if not isinstance(stop, list) or len(stop) > 4 or not all(isinstance(s, str) and s for s in stop):
        raise RequestError("'stop' must be a string or a list of up to 4 non-empty strings", param="stop")
    seed = body.get("seed")
    if seed is not None and (not isinstance(seed, int) or isinstance(seed, bool)):
        raise RequestError("'seed' must be an integer", param="seed")
    for m in messages:
        normalize(m)  # raises for a malformed message
    return {"messages": messages, "tools": tools or None, "max_tokens": max_tokens, "n": n, "stop": stop,
            "seed": seed, "stream": bool(body.get("stream")),
            "include_usage": bool((body.get("stream_options") or {}).get("include_usage"))
            if isinstance(body.get("stream_options"), Mapping) else False,
            "tool_choice": choice}


def _cut_at_stop(tokenizer: Any, ids: list[int], stop: Sequence[str]) -> tuple[int, str] | None:
    """``(tokens kept, text before the stop string)`` when a stop string occurs in the decoded ``ids``."""
    if not stop:
        return None
    text = tokenizer.decode(ids, skip_special_tokens=True)
    hits = [i for i in (text.find(s) for s in stop) if i >= 0]
    if not hits:
        return None
    at = min(hits)
    end = at + min(len(s) for s in stop if text.find(s) == at)
    lo, hi = 1, len(ids)  # the first token by which the stop string is complete (decoded length grows with k)
    while lo < hi:
        mid = (lo + hi) // 2
        if len(tokenizer.decode(ids[:mid], skip_special_tokens=True)) >= end:
            hi = mid
        else:
            lo = mid + 1
    return lo, text[:at]


def _call_id() -> str:
    return "".join(secrets.choice(_ID_CHARS) for _ in range(9))


def complete(traj: Trajectory, body: Any) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """Serve one chat completion for ``traj``: ``(request options, choices)``; each choice is recorded."""
    req = _check_body(body)
    if traj.closed:
        raise RequestError("this trajectory has ended (its program ran past its deadline or returned)", status=410)
    with traj.lock:
        if len(traj.calls) >= traj.max_calls:
            raise RequestError(f"this episode made its {traj.max_calls} chat completions "
                               "(agent.openai_agent.max_calls)", status=429)
    prompt_ids, parent, delta_ids = traj.prompt_for(req["messages"], req["tools"])
    if parent is None or traj.per_call:
        limit = traj.max_prompt_length
        if limit and len(prompt_ids) > limit:
            traj.count("budget_refusals")
            raise RequestError(f"the prompt is {len(prompt_ids)} tokens; data.max_prompt_length is {limit}"
                               + (" (samples=per_call: every call's prompt is a sample's prompt)" if parent is not None
                                  else ""), code="context_length_exceeded", param="messages")
        left = traj.budget
    else:
        left = traj.budget - (len(prompt_ids) - traj.root_length(parent))
    if left <= 0:
        traj.count("budget_refusals")
        raise RequestError(f"this conversation used its {traj.budget} response tokens (data.max_response_length)",
                           code="context_length_exceeded", param="messages")
    budget = min(left, req["max_tokens"] or left)
    seed = req["seed"]
    base_seed = traj.sampling_params.seed
    if seed is None and base_seed is not None:  # a seeded run: a seed per call, or every call replays the first
        seed = (base_seed * 1_000_003 + len(traj.calls)) % 2**31
    params = traj.sampling_params.replace(n=req["n"], max_new_tokens=budget, seed=seed)
    request = GenerationRequest(prompt_ids=list(prompt_ids), sampling_params=params,
                                request_id=f"{traj.uid}/call{len(traj.calls)}")
    timeout = traj.deadline - time.monotonic()
    if timeout <= 0:
        raise RequestError("the episode's deadline has passed", status=410)
    future = asyncio.run_coroutine_threadsafe(traj.client.agenerate(request), traj.loop)
    try:
        results = future.result(timeout=timeout)
    except TimeoutError:
        future.cancel()
        raise RequestError("the episode's deadline passed while sampling", status=410) from None
    messages_norm = [normalize(m) for m in req["messages"]]
    tools_key = json.dumps(req["tools"] or [], sort_keys=True)
    allowed = {t["function"]["name"]: t["function"] for t in (req["tools"] or [])}
    choices = []
    for i, result in enumerate(results):
        ids = list(result.response_ids)
        lps = list(result.log_probs) or [0.0] * len(ids)
        finish = "length" if result.finish_reason == "length" else "stop"
        cut = _cut_at_stop(traj.tokenizer, ids, req["stop"])
        if cut is not None:
            k, text = cut
            ids, lps, finish = ids[:k], lps[:k], "stop"
        else:
            text = traj.tokenizer.decode(ids, skip_special_tokens=True)
        message: dict[str, Any] = {"role": "assistant", "content": text}
        n_calls = n_errors = 0
        if allowed and req["tool_choice"] != "none":
            parsed = _parse(traj.parser, text, allowed)
            n_errors = len(parsed.errors)
            calls = [{"id": c.id if isinstance(c.id, str) and c.id else _call_id(), "type": "function",
                      "function": {"name": c.name, "arguments": json.dumps(c.arguments)}} for c in parsed.calls]
            n_calls = len(calls) + n_errors
            if calls:
                message = {"role": "assistant", "content": text if n_errors else (parsed.content or None),
                           "tool_calls": calls}
                finish = "tool_calls" if finish == "stop" else finish
        traj.record(prompt_ids=list(prompt_ids), response_ids=ids, log_probs=lps,
                    finish_reason="length" if finish == "length" else "stop", parent=parent,
                    delta_ids=list(delta_ids), history=[*messages_norm, normalize(message)], tools_key=tools_key,
                    tool_calls=n_calls, parse_errors=n_errors)
        choices.append({"index": i, "message": message, "finish_reason": finish, "logprobs": None,
                        "_tokens": len(ids)})
    return {**req, "prompt_tokens": len(prompt_ids)}, choices


def _parse(parser: Any, text: str, allowed: Mapping[str, Any]) -> Any:
    from polyrl.tools.parsers import ParsedTurn

    try:
        try:
            return parser.parse(text, tools=dict(allowed))
        except TypeError:
            return parser.parse(text)
    except Exception as exc:  # nothing a model writes may fail the request
        return ParsedTurn(text, [], [f"{type(exc).__name__}: {exc}"])


# ---------------------------------------------------------------------- the HTTP server

class ProxyServer(ThreadingHTTPServer):
    """The endpoint: one per process, on 127.0.0.1; trajectories come and go by key."""

    daemon_threads = True
    #: the listen backlog: many programs connect at once (the standard library's default of 5 refuses them)
    request_queue_size = 1024

    def __init__(self) -> None:
        super().__init__(("127.0.0.1", 0), _Handler)
        self.trajectories: dict[str, Trajectory] = {}
        self._lock = threading.Lock()
        self.base_url = f"http://127.0.0.1:{self.server_address[1]}/v1"
        self._thread = threading.Thread(target=self.serve_forever, kwargs={"poll_interval": 0.2},
                                        name="polyrl-openai-proxy", daemon=True)
        self._thread.start()

    def open(self, **kwargs: Any) -> Trajectory:
        """Register a new trajectory under a fresh random key."""
        key = "polyrl-" + secrets.token_urlsafe(24)
        traj = Trajectory(key=key, **kwargs)
        with self._lock:
            self.trajectories[key] = traj
        return traj

    def close_trajectory(self, traj: Trajectory) -> None:
        """Revoke the trajectory's key: later requests with it get 401."""
        traj.closed = True
        with self._lock:
            self.trajectories.pop(traj.key, None)

    def lookup(self, key: str) -> Trajectory | None:
        with self._lock:
            return self.trajectories.get(key)

    def stop(self) -> None:
        self.shutdown()
        self.server_close()


_PROXY: ProxyServer | None = None
_PROXY_LOCK = threading.Lock()


def get_proxy() -> ProxyServer:
    """This process's endpoint, started on first use."""
    global _PROXY
    with _PROXY_LOCK:
        if _PROXY is None:
            _PROXY = ProxyServer()
            logger.info("openai_agent: local OpenAI endpoint at %s (loopback only)", _PROXY.base_url)
        return _PROXY


class _Handler(BaseHTTPRequestHandler):
    server: ProxyServer
    protocol_version = "HTTP/1.1"

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - the base class's name
        logger.debug("openai_agent proxy: " + format, *args)

    def _json(self, status: int, doc: dict[str, Any]) -> None:
        data = json.dumps(doc).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _error(self, exc: RequestError) -> None:
        kind = "invalid_request_error" if exc.status < 500 else "server_error"
        self._json(exc.status, {"error": {"message": str(exc), "type": kind, "param": exc.param,
                                          "code": exc.code}})

    def _trajectory(self) -> Trajectory:
        auth = self.headers.get("Authorization") or ""
        key = auth[7:].strip() if auth.lower().startswith("bearer ") else ""
        traj = self.server.lookup(key) if key else None
        if traj is None:
            raise RequestError("unknown or expired API key (each episode has its own)", status=401,
                               code="invalid_api_key")
        return traj

    def _route(self) -> str:
        return self.path.split("?", 1)[0].rstrip("/")

    def do_GET(self) -> None:  # noqa: N802 - http.server's name
        try:
            self._trajectory()
            if self._route() in ("/v1/models", "/models"):
                self._json(200, {"object": "list", "data": [{"id": "polyrl-policy", "object": "model",
                                                             "created": 0, "owned_by": "polyrl"}]})
            else:
                raise RequestError(f"no route {self.path}", status=404)
        except RequestError as exc:
            self._error(exc)

    def do_POST(self) -> None:  # noqa: N802
        traj = None
        try:
            traj = self._trajectory()
            if self._route() not in ("/v1/chat/completions", "/chat/completions"):
                raise RequestError(f"no route {self.path}; this endpoint serves POST /v1/chat/completions",
                                   status=404)
            length = int(self.headers.get("Content-Length") or 0)
            if length > MAX_BODY_BYTES:
                raise RequestError(f"the request body is {length} bytes; at most {MAX_BODY_BYTES}", status=413)
            try:
                body = json.loads(self.rfile.read(length) or b"null")
            except ValueError:
                raise RequestError("the request body is not JSON") from None
            req, choices = complete(traj, body)
            self._answer(req, choices)
        except RequestError as exc:
            if traj is not None and exc.status < 500 and exc.status not in (401, 410):
                traj.count("bad_requests", f"HTTP {exc.status}: {exc}")
            self._error(exc)
        except (BrokenPipeError, ConnectionResetError):
            logger.debug("openai_agent proxy: the client went away")
        except Exception as exc:  # a rollout failure: the program sees a 500, the run goes on
            logger.warning("openai_agent proxy: a request failed: %s: %s", type(exc).__name__, exc, exc_info=True)
            if traj is not None:
                traj.count("server_errors", f"{type(exc).__name__}: {exc}")
            try:
                self._error(RequestError(f"{type(exc).__name__}: {exc}", status=500))
            except OSError:
                pass

    def _answer(self, req: dict[str, Any], choices: list[dict[str, Any]]) -> None:
        base = {"id": "chatcmpl-" + uuid.uuid4().hex, "created": int(time.time()), "model": "polyrl-policy"}
        completion = sum(c.pop("_tokens") for c in choices)
        usage = {"prompt_tokens": req["prompt_tokens"], "completion_tokens": completion,
                 "total_tokens": req["prompt_tokens"] + completion}
        if not req["stream"]:
            self._json(200, {**base, "object": "chat.completion", "choices": choices, "usage": usage})
            return
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Cache-Control", "no-cache")
        self.send_header("Connection", "close")
        self.end_headers()
        self.close_connection = True

        def event(doc: Any) -> None:
            self.wfile.write(f"data: {doc if isinstance(doc, str) else json.dumps(doc)}\n\n".encode())

        chunk = {**base, "object": "chat.completion.chunk"}
        for c in choices:
            msg = c["message"]
            event({**chunk, "choices": [{"index": c["index"], "delta": {"role": "assistant", "content": ""},
                                         "finish_reason": None}]})
            if msg.get("content"):
                event({**chunk, "choices": [{"index": c["index"], "delta": {"content": msg["content"]},
                                             "finish_reason": None}]})
            for j, call in enumerate(msg.get("tool_calls") or []):
                event({**chunk, "choices": [{"index": c["index"], "delta": {"tool_calls": [
                    {"index": j, **call}]}, "finish_reason": None}]})
            event({**chunk, "choices": [{"index": c["index"], "delta": {}, "finish_reason": c["finish_reason"]}]})
        if req["include_usage"]:
            event({**chunk, "choices": [], "usage": usage})
        event("[DONE]")
        self.wfile.flush()
