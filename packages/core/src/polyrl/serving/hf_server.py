"""The ``hf`` backend of ``polyrl serve``: an OpenAI-compatible HTTP server over a transformers model.

Endpoints: ``GET /v1/models``, ``POST /v1/completions``, ``POST /v1/chat/completions`` (the prompt
rendered with the tokenizer's chat template), each with ``stream: true`` as server-sent events ending
in ``data: [DONE]``. Sampling: ``max_tokens``, ``temperature`` (0: greedy), ``top_p``, ``n``, ``stop``,
``seed``. Requests are served one at a time from a thread per connection (the standard library's
``ThreadingHTTPServer``; no extra dependency), which is plenty for looking at what a run learned and
far from what vLLM does with many requests in flight.

Every request is bounded before it costs anything (docs/serving.md, "Limits"): a body over
``max_request_bytes`` is refused with 413 from its ``Content-Length`` (or as soon as a chunked body passes
it) without being read; a body must arrive within :data:`BODY_DEADLINE_S`; a prompt longer in characters
than the model's length can hold in tokens is refused with 400 before it is tokenized; a connection idle
for :data:`IDLE_TIMEOUT_S` is closed. A client that leaves mid-answer is one debug line.
"""

from __future__ import annotations

import json
import logging
import signal
import socket
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

log = logging.getLogger("polyrl.serve")

#: ``max_tokens`` of a completion request that gives none (OpenAI's default).
DEFAULT_COMPLETION_TOKENS = 16
#: Largest request body accepted (``polyrl serve --max-request-bytes``); a larger one is answered 413 unread.
MAX_REQUEST_BYTES = 8 << 20
#: Seconds a request's body has, from its headers, to arrive whole (a client trickling it is answered 408).
BODY_DEADLINE_S = 30.0
#: Seconds a connection may sit idle (no request, or a stalled read or write) before it is closed.
IDLE_TIMEOUT_S = 60.0
#: Connections served at once; one more is answered 503 at once (each has a thread, and may be a slow client).
MAX_CONNECTIONS = 32
#: Most sequences one request may ask for (prompts times ``n``): they are generated one after another.
MAX_CHOICES = 64
#: A prompt over this many characters a token of the model's length is tokenized in part first (see
#: ``HFGenerator._check_text``): typical text is 3-5 characters a token.
PROBE_CHARS_PER_TOKEN = 8
#: Routes and the methods they answer.
ROUTES = {"/v1/models": "GET", "/models": "GET", "/health": "GET", "": "GET", "/v1/completions": "POST",
          "/v1/chat/completions": "POST"}


class RequestError(Exception):
    """A request the server refuses: the HTTP status and an OpenAI-style error message."""

    def __init__(self, message: str, status: int = 400, param: str | None = None) -> None:
        super().__init__(message)
        self.status, self.param = status, param


class HFGenerator:
    """A causal LM and its tokenizer, generating one sequence at a time with a KV cache."""

    def __init__(self, model_dir: str | Path, *, trust_remote_code: bool = False, max_model_len: int | None = None,
                 device: str | None = None) -> None:
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        if device is None:  # the first accelerator of the detected platform, else the CPU
            from polyrl.platforms import detect_platform

            platform = detect_platform()
            if platform.device_type != "cpu":
                platform.set_device(0)
            device = str(platform.current_device())
        self.tokenizer = AutoTokenizer.from_pretrained(model_dir, trust_remote_code=trust_remote_code)
        self.model = AutoModelForCausalLM.from_pretrained(model_dir, trust_remote_code=trust_remote_code,
                                                          dtype=torch.float32 if device == "cpu" else "auto")
        self.model.to(device).eval()
        self.device = device
        positions = getattr(self.model.config, "max_position_embeddings", None) or 2048
        self.max_model_len = min(max_model_len or positions, positions)
        eos = self.model.generation_config.eos_token_id
        if eos is None:
            eos = self.tokenizer.eos_token_id
        self.eos_ids = set(eos if isinstance(eos, list) else [eos]) - {None}
        # no token is longer than its longest vocabulary entry (byte-level entries have one character a byte), so a
        # prompt of more characters than this cannot fit the model: refused before tokenizing it
        self.max_prompt_chars = self.max_model_len * _longest_token(self.tokenizer)
        self.lock = threading.Lock()  # one generation at a time: the model is not re-entrant

    def _check_text(self, text: str, param: str) -> None:
        """A 400 for a prompt too long for the model, found without tokenizing all of a long one: over
        :attr:`max_prompt_chars` it cannot fit; over :data:`PROBE_CHARS_PER_TOKEN` characters a token, its first
        that many characters are tokenized, and refused when they alone are over the length."""
        if len(text) > self.max_prompt_chars:
            raise RequestError(f"the prompt has {len(text)} characters, more than this model's {self.max_model_len} "
                               f"tokens can hold (at most {self.max_prompt_chars} characters); shorten it", param=param)
        probe = PROBE_CHARS_PER_TOKEN * self.max_model_len
        if len(text) > probe:
            head = len(self.tokenizer(text[:probe], add_special_tokens=False)["input_ids"])
            if head > self.max_model_len + 16:  # a cut word is a few tokens more than whole, never 16
                raise RequestError(f"the prompt's first {probe} characters alone are {head} tokens; this model takes "
                                   f"at most {self.max_model_len} tokens in all; shorten it", param=param)

    def chat_prompt(self, messages: list[dict[str, Any]]) -> list[int]:
        """Token ids of ``messages`` rendered by the chat template, with the assistant turn opened."""
        if not getattr(self.tokenizer, "chat_template", None):
            raise RequestError("this model's tokenizer has no chat template; use /v1/completions with a plain prompt")
        if not isinstance(messages, list) or not messages:
            raise RequestError("'messages' must be a non-empty list of {role, content}", param="messages")
        for i, m in enumerate(messages):
            if not isinstance(m, dict) or not isinstance(m.get("role"), str):
                raise RequestError(f"messages[{i}] needs a 'role' (a string) and a 'content'", param="messages")
            content = m.get("content")
            if isinstance(content, list):  # OpenAI content parts: keep the text ones
                m["content"] = "".join(str(p.get("text", "")) for p in content if isinstance(p, dict))
            elif not isinstance(content, str):
                got = "null" if content is None else type(content).__name__
                raise RequestError(f"messages[{i}].content must be a string or a list of content parts, got {got}",
                                   param=f"messages[{i}].content")
        self._check_text("".join(m["content"] for m in messages), "messages")
        ids = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        if isinstance(ids, dict) or hasattr(ids, "input_ids"):  # newer transformers return a BatchEncoding
            ids = ids["input_ids"]
        return list(ids)

    def text_prompt(self, prompt: str) -> list[int]:
        """Token ids of a plain prompt (the tokenizer's own special tokens added, as vLLM does)."""
        self._check_text(prompt, "prompt")
        return list(self.tokenizer(prompt)["input_ids"])

    def stream(self, prompt_ids: list[int], *, max_tokens: int, temperature: float, top_p: float,
               stop: list[str], seed: int | None) -> Iterator[tuple[str, str | None, int]]:
        """Generate, yielding ``(new text, finish_reason or None, tokens so far)``; the last item has the reason.

        Text is held back while it could be the start of a stop string or of a multi-byte character, so what
        is yielded never has to be taken back.
        """
        import torch

        from polyrl.models.kv_cache import cache_kwargs, new_cache

        if len(prompt_ids) >= self.max_model_len:
            raise RequestError(f"the prompt has {len(prompt_ids)} tokens; this model takes at most "
                               f"{self.max_model_len} tokens in all", param="prompt")
        budget = min(max_tokens, self.max_model_len - len(prompt_ids))
        generator = torch.Generator(device=self.device)
        generator.manual_seed(seed if seed is not None else int.from_bytes(uuid.uuid4().bytes[:4], "little"))
        cache = cache_kwargs(self.model, new_cache(self.model))  # under the name this transformers takes: no warning
        inputs = torch.tensor([prompt_ids], device=self.device)
        tokens: list[int] = []
        sent = ""
        reason = "length"
        stopped = False  # by a stop string
        with torch.inference_mode():
            for _ in range(budget):
                out = self.model(input_ids=inputs, use_cache=True, **cache)
                logits = out.logits[0, -1].float()
                token = _sample(logits, temperature, top_p, generator)
                if token in self.eos_ids:
                    reason = "stop"
                    break
                tokens.append(token)
                inputs = torch.tensor([[token]], device=self.device)
                text = self.tokenizer.decode(tokens, skip_special_tokens=True)
                hit = min((i for i in (text.find(s) for s in stop if s) if i >= 0), default=-1)
                if hit >= 0:
                    if hit > len(sent):
                        yield text[len(sent):hit], None, len(tokens)
                    sent = text[:hit]
                    reason, stopped = "stop", True
                    break
                safe = len(text)
                if text.endswith("\ufffd"):
                    safe = len(text.rstrip("\ufffd"))
                for s in stop:  # hold back a tail that may grow into a stop string
                    for k in range(min(len(s) - 1, len(text)), 0, -1):
                        if text.endswith(s[:k]):
                            safe = min(safe, len(text) - k)
                            break
                if safe > len(sent):
                    yield text[len(sent):safe], None, len(tokens)
                    sent = text[:safe]
        # what was held back (a partial stop string) goes out last; bytes of a character that never completed
        # are dropped, as vLLM's detokenizer does
        rest = "" if stopped else self.tokenizer.decode(tokens, skip_special_tokens=True)[len(sent):].rstrip("\ufffd")
        yield rest, reason, len(tokens)


def _longest_token(tokenizer: Any) -> int:
    """Characters of the tokenizer's longest vocabulary entry (special tokens included); 64 when it has no
    vocabulary to read."""
    try:
        vocab = tokenizer.get_vocab()
    except (AttributeError, NotImplementedError, TypeError):
        return 64
    return max((len(token) for token in vocab), default=64) or 1


def _sample(logits: Any, temperature: float, top_p: float, generator: Any) -> int:
    import torch

    if temperature <= 0:
        return int(logits.argmax())
    probs = torch.softmax(logits / temperature, dim=-1)
    if top_p < 1.0:
        sorted_probs, order = probs.sort(descending=True)
        keep = sorted_probs.cumsum(-1) - sorted_probs < top_p
        keep[0] = True
        probs = torch.zeros_like(probs).scatter(0, order[keep], sorted_probs[keep])
    return int(torch.multinomial(probs, 1, generator=generator))


def _params(body: dict[str, Any], default_max: int) -> dict[str, Any]:
    def number(key: str, default: float, lo: float, hi: float) -> float:
        value = body.get(key, default)
        if value is None:
            return default
        if not isinstance(value, (int, float)) or isinstance(value, bool) or not lo <= value <= hi:
            raise RequestError(f"'{key}' must be a number in [{lo}, {hi}]", param=key)
        return float(value)

    max_tokens = body.get("max_completion_tokens", body.get("max_tokens"))
    if max_tokens is None:
        max_tokens = default_max
    if not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or max_tokens < 1:
        raise RequestError("'max_tokens' must be a positive integer", param="max_tokens")
    stop = body.get("stop") or []
    if isinstance(stop, str):
        stop = [stop]
    if not isinstance(stop, list) or not all(isinstance(s, str) for s in stop):
        raise RequestError("'stop' must be a string or a list of strings", param="stop")
    n = body.get("n")
    if n is None:
        n = 1
    if not isinstance(n, int) or isinstance(n, bool) or not 1 <= n <= 16:
        raise RequestError("'n' must be an integer from 1 to 16", param="n")
    seed = body.get("seed")
    if seed is not None and (not isinstance(seed, int) or isinstance(seed, bool)):
        raise RequestError("'seed' must be an integer", param="seed")
    for unsupported in ("logprobs", "top_logprobs", "echo", "best_of", "tools", "suffix"):
        if body.get(unsupported):
            raise RequestError(f"'{unsupported}' is not supported by the hf backend of polyrl serve (use the vllm "
                               "backend)", param=unsupported)
    return {"max_tokens": max_tokens, "temperature": number("temperature", 1.0, 0.0, 2.0),
            "top_p": number("top_p", 1.0, 0.0, 1.0), "stop": stop, "n": n, "seed": seed}


class OpenAIServer(ThreadingHTTPServer):
    """The HTTP server: :class:`HFGenerator` behind the OpenAI routes."""

    daemon_threads = True
    allow_reuse_address = True

    def __init__(self, address: tuple[str, int], generator: HFGenerator, model_name: str, *,
                 max_request_bytes: int = MAX_REQUEST_BYTES) -> None:
        super().__init__(address, _Handler)
        self.generator, self.model_name = generator, model_name
        self.max_request_bytes = max_request_bytes
        self.created = int(time.time())
        self._slots = threading.BoundedSemaphore(MAX_CONNECTIONS)

    def process_request(self, request: Any, client_address: Any) -> None:
        """A thread for the connection, or a 503 when :data:`MAX_CONNECTIONS` are open."""
        if not self._slots.acquire(blocking=False):
            log.debug("client %s refused: %d connections open", client_address, MAX_CONNECTIONS)
            try:
                request.sendall(b"HTTP/1.1 503 Service Unavailable\r\nRetry-After: 1\r\nContent-Length: 0\r\n"
                                b"Connection: close\r\n\r\n")
            except OSError:
                pass
            self.shutdown_request(request)
            return
        super().process_request(request, client_address)

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self._slots.release()


class _Handler(BaseHTTPRequestHandler):
    server: OpenAIServer
    protocol_version = "HTTP/1.1"
    timeout = IDLE_TIMEOUT_S  # on the connection's socket: no read or write waits longer

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - the base class's name
        log.info("%s %s", self.address_string(), format % args)

    def handle(self) -> None:
        try:
            super().handle()
        except (ConnectionError, TimeoutError) as exc:  # the client left (mid-answer) or stalled: not our error
            log.debug("client %s went away: %s", self.address_string(), exc)
            self.close_connection = True

    # --------------------------------------------------------------- plumbing
    def _json(self, status: int, doc: dict[str, Any], headers: dict[str, str] | None = None) -> None:
        data = json.dumps(doc).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        for key, value in (headers or {}).items():
            self.send_header(key, value)
        if self.close_connection:
            self.send_header("Connection", "close")
        self.end_headers()
        self.wfile.write(data)

    def _error(self, exc: RequestError, headers: dict[str, str] | None = None) -> None:
        kind = "invalid_request_error" if exc.status < 500 else "server_error"
        self._json(exc.status, {"error": {"message": str(exc), "type": kind, "param": exc.param,
                                          "code": HTTPStatus(exc.status).phrase.lower().replace(" ", "_")}}, headers)

    def _refuse_unread(self, exc: RequestError, headers: dict[str, str] | None = None) -> None:
        """Answer ``exc`` without reading the request's body, then close the connection (what is left of the body
        cannot be told from a next request). A client still sending is given a moment and a bounded amount of
        discarding, so that it reads the answer rather than a reset connection. A request without a body keeps its
        connection."""
        chunked = "chunked" in self.headers.get("Transfer-Encoding", "").lower()
        if not chunked and (self.headers.get("Content-Length") or "0").strip() == "0":
            self._error(exc, headers)
            return
        self.close_connection = True
        self._error(exc, headers)
        self.wfile.flush()
        try:
            self.connection.shutdown(socket.SHUT_WR)
            self.connection.settimeout(0.5)
            deadline, left = time.monotonic() + 2.0, 4 * self.server.max_request_bytes
            while left > 0 and time.monotonic() < deadline and self.rfile.read1(min(left, 1 << 16)):
                left -= 1 << 16
        except OSError:
            pass

    def _expected_length(self) -> int | None:
        """The body's length from ``Content-Length`` (None for a chunked body); a 413 when it is over the bound."""
        if "chunked" in self.headers.get("Transfer-Encoding", "").lower():
            return None
        text = self.headers.get("Content-Length") or "0"
        if not text.strip().isdigit():
            raise RequestError(f"Content-Length {text!r} is not a number of bytes")
        length = int(text)
        if length > self.server.max_request_bytes:
            raise RequestError(f"the request body has {length} bytes; this server takes at most "
                               f"{self.server.max_request_bytes} (polyrl serve --max-request-bytes)", status=413)
        return length

    def handle_expect_100(self) -> bool:
        """``Expect: 100-continue`` (curl's way with a large body): refuse before the client sends it."""
        if self.command == "POST" and self.path.split("?")[0].rstrip("/") in ROUTES:
            try:
                self._expected_length()
            except RequestError as exc:
                self.close_connection = True
                self._error(exc)
                return False
        return super().handle_expect_100()

    def _read(self, count: int, deadline: float) -> bytes:
        """``count`` bytes of the body, before ``deadline`` (a 408 after it)."""
        parts: list[bytes] = []
        while count > 0:
            left = deadline - time.monotonic()
            if left <= 0:
                raise RequestError(f"the request body did not arrive within {BODY_DEADLINE_S:.0f} s", status=408)
            self.connection.settimeout(left)
            try:
                data = self.rfile.read1(min(count, 1 << 16))
            except TimeoutError:  # the socket cannot be read after a timeout: the connection ends here
                raise RequestError(f"the request body did not arrive within {BODY_DEADLINE_S:.0f} s", status=408) from None
            if not data:
                raise ConnectionResetError("the client closed the connection while sending its request")
            parts.append(data)
            count -= len(data)
        return b"".join(parts)

    def _read_chunked(self, deadline: float) -> bytes:
        """A ``Transfer-Encoding: chunked`` body, refused with 413 as soon as it passes the bound."""
        parts: list[bytes] = []
        total = 0
        while True:
            line = self._read_line(deadline)
            try:
                size = int(line.split(b";")[0].strip(), 16)
            except ValueError:
                raise RequestError("the chunked request body is malformed") from None
            if size == 0:
                for _ in range(100):  # trailer fields, up to the blank line
                    if not self._read_line(deadline).strip():
                        break
                return b"".join(parts)
            total += size
            if total > self.server.max_request_bytes:
                raise RequestError(f"the request body has more than {self.server.max_request_bytes} bytes (polyrl "
                                   "serve --max-request-bytes)", status=413)
            parts.append(self._read(size, deadline))
            self._read(2, deadline)  # the chunk's CRLF

    def _read_line(self, deadline: float) -> bytes:
        line = b""
        while not line.endswith(b"\n"):
            if len(line) > 1024:
                raise RequestError("the chunked request body is malformed")
            line += self._read(1, deadline)
        return line

    def _body(self) -> dict[str, Any]:
        deadline = time.monotonic() + BODY_DEADLINE_S
        length = self._expected_length()
        try:
            raw = self._read_chunked(deadline) if length is None else self._read(length, deadline)
        finally:
            self.connection.settimeout(self.timeout)
        try:
            body = json.loads(raw or b"{}")
        except ValueError:
            raise RequestError("the request body is not JSON") from None
        if not isinstance(body, dict):
            raise RequestError("the request body must be a JSON object")
        model = body.get("model")
        if model is None:  # OpenAI's API requires it too
            raise RequestError(f"you must provide a model parameter ('model': '{self.server.model_name}')",
                               param="model")
        if model != self.server.model_name:
            raise RequestError(f"the model '{model}' does not exist; this server serves '{self.server.model_name}'",
                               status=404, param="model")
        return body

    def _start_events(self) -> None:
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Cache-Control", "no-cache")
        self.send_header("Connection", "close")
        self.end_headers()
        self.close_connection = True

    def _event(self, doc: dict[str, Any] | str) -> None:
        data = doc if isinstance(doc, str) else json.dumps(doc)
        self.wfile.write(f"data: {data}\n\n".encode())
        self.wfile.flush()

    # --------------------------------------------------------------- routes
    def _route(self) -> str | None:
        """This request's route when this method serves it; otherwise the 404 or 405 answer is sent (body unread)
        and None returned."""
        route = self.path.split("?")[0].rstrip("/")
        allowed = ROUTES.get(route)
        if allowed is None:
            self._refuse_unread(RequestError(f"no route {self.path}", status=404))
            return None
        if allowed != self.command:
            self._refuse_unread(RequestError(f"{self.path} takes {allowed}, not {self.command}", status=405),
                                {"Allow": allowed})
            return None
        return route

    def do_GET(self) -> None:  # noqa: N802 - http.server's name
        route = self._route()
        if route in ("/v1/models", "/models"):
            s = self.server
            self._json(200, {"object": "list", "data": [{"id": s.model_name, "object": "model", "created": s.created,
                                                         "owned_by": "polyrl"}]})
        elif route is not None:
            self._json(200, {"status": "ok"})

    def do_PUT(self) -> None:  # noqa: N802 - every other method: 405 on a route, 404 elsewhere
        self._route()

    do_DELETE = do_PATCH = do_PUT  # noqa: N815

    def do_POST(self) -> None:  # noqa: N802
        route = self._route()
        if route is None:
            return
        try:
            body = self._body()
        except RequestError as exc:
            if exc.status in (408, 413):  # the body was not read (whole): the connection cannot go on
                self._refuse_unread(exc)
            else:
                self._error(exc)
            return
        try:
            if route == "/v1/completions":
                self._completion(body)
            else:
                self._chat(body)
        except RequestError as exc:
            self._error(exc)
        except (ConnectionError, TimeoutError) as exc:  # the client went away mid-answer
            log.debug("client %s went away mid-answer: %s", self.address_string(), exc)
            self.close_connection = True
        except Exception as exc:  # a bug or a model failure: answer 500, keep serving
            log.exception("request %s failed", route)
            try:
                self._error(RequestError(f"{type(exc).__name__}: {exc}", status=500))
            except OSError:
                pass

    def _completion(self, body: dict[str, Any]) -> None:
        gen = self.server.generator
        prompt = body.get("prompt")
        prompts = [prompt] if isinstance(prompt, str) else prompt
        if not isinstance(prompts, list) or not prompts or not all(isinstance(p, str) for p in prompts):
            raise RequestError("'prompt' must be a string or a list of strings", param="prompt")
        params = _params(body, DEFAULT_COMPLETION_TOKENS)
        if len(prompts) * params["n"] > MAX_CHOICES:
            raise RequestError(f"{len(prompts)} prompts times n={params['n']} asks for more than {MAX_CHOICES} "
                               "completions in one request; split it", param="prompt")
        jobs = [(i * params["n"] + j, gen.text_prompt(p)) for i, p in enumerate(prompts) for j in range(params["n"])]
        self._respond(body, jobs, params, chat=False)

    def _chat(self, body: dict[str, Any]) -> None:
        gen = self.server.generator
        ids = gen.chat_prompt(body.get("messages"))  # type: ignore[arg-type]
        params = _params(body, gen.max_model_len)
        self._respond(body, [(j, ids) for j in range(params["n"])], params, chat=True)

    def _respond(self, body: dict[str, Any], jobs: list[tuple[int, list[int]]], params: dict[str, Any],
                 *, chat: bool) -> None:
        gen = self.server.generator
        rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        base = {"id": rid, "created": int(time.time()), "model": self.server.model_name}
        kwargs = {k: params[k] for k in ("max_tokens", "temperature", "top_p", "stop")}

        def run(index: int, ids: list[int]) -> Iterator[tuple[str, str | None, int]]:
            seed = params["seed"] + index if params["seed"] is not None else None
            return gen.stream(ids, seed=seed, **kwargs)

        stream = bool(body.get("stream"))
        with gen.lock:
            if stream:
                self._stream(base, jobs, run, chat=chat,
                             usage=bool((body.get("stream_options") or {}).get("include_usage")))
                return
            choices, prompt_tokens, completion_tokens = [], 0, 0
            for index, ids in jobs:
                text, reason, count = "", "length", 0
                for piece, finish, tokens in run(index, ids):
                    text += piece
                    reason, count = finish or reason, tokens
                prompt_tokens += len(ids)
                completion_tokens += count
                if chat:
                    choices.append({"index": index, "message": {"role": "assistant", "content": text},
                                    "finish_reason": reason, "logprobs": None})
                else:
                    choices.append({"index": index, "text": text, "finish_reason": reason, "logprobs": None})
        usage = {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                 "total_tokens": prompt_tokens + completion_tokens}
        self._json(200, {**base, "object": "chat.completion" if chat else "text_completion", "choices": choices,
                         "usage": usage})

    def _stream(self, base: dict[str, Any], jobs: list[tuple[int, list[int]]],
                run: Callable[[int, list[int]], Iterator[tuple[str, str | None, int]]], *, chat: bool,
                usage: bool) -> None:
        kind = "chat.completion.chunk" if chat else "text_completion"
        self._start_events()
        prompt_tokens = completion_tokens = 0
        for index, ids in jobs:
            if chat:
                self._event({**base, "object": kind, "choices": [
                    {"index": index, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}]})
            count = 0
            for piece, finish, tokens in run(index, ids):
                count = tokens
                if not piece and finish is None:
                    continue
                if chat:
                    delta = {"content": piece} if piece else {}
                    choice = {"index": index, "delta": delta, "finish_reason": finish, "logprobs": None}
                else:
                    choice = {"index": index, "text": piece, "finish_reason": finish, "logprobs": None}
                self._event({**base, "object": kind, "choices": [choice]})
            prompt_tokens += len(ids)
            completion_tokens += count
        if usage:
            self._event({**base, "object": kind, "choices": [], "usage": {
                "prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                "total_tokens": prompt_tokens + completion_tokens}})
        self._event("[DONE]")


def run_hf_server(model_dir: str | Path, model_name: str, *, host: str = "127.0.0.1", port: int = 8000,
                  trust_remote_code: bool = False, max_model_len: int | None = None,
                  max_request_bytes: int = MAX_REQUEST_BYTES, ready: Callable[[str], None] | None = None) -> int:
    """Load the model, serve until SIGINT/SIGTERM, then close the socket; returns 0."""
    generator = HFGenerator(model_dir, trust_remote_code=trust_remote_code, max_model_len=max_model_len)
    server = OpenAIServer((host, port), generator, model_name, max_request_bytes=max_request_bytes)
    url = f"http://{host if ':' not in host else f'[{host}]'}:{server.server_address[1]}/v1"
    stopping = threading.Event()

    def stop(signum: int, frame: Any) -> None:
        if not stopping.is_set():
            stopping.set()
            log.info("polyrl serve: %s received, stopping", signal.Signals(signum).name)
            threading.Thread(target=server.shutdown, daemon=True).start()

    previous = {}
    if threading.current_thread() is threading.main_thread():
        previous = {sig: signal.signal(sig, stop) for sig in (signal.SIGINT, signal.SIGTERM)}
    log.info("polyrl serve: model '%s' from %s at %s (hf backend); stop with Ctrl-C", model_name, model_dir, url)
    try:
        if ready is not None:
            ready(url)
        server.serve_forever(poll_interval=0.2)
    finally:
        server.server_close()
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    log.info("polyrl serve: stopped")
    return 0
