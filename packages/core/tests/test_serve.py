"""``polyrl serve`` with the hf backend: the openai client against the real server over a tiny model.

The in-process tests run :class:`polyrl.serving.hf_server.OpenAIServer` on a thread; the last one runs
``polyrl serve`` as a process and stops it with SIGINT and SIGTERM, as a user would.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

openai = pytest.importorskip("openai")

from polyrl.cli import main  # noqa: E402
from polyrl.serving.hf_server import HFGenerator, OpenAIServer  # noqa: E402


@pytest.fixture(scope="module")
def server(tiny_model_dir):
    generator = HFGenerator(tiny_model_dir)
    srv = OpenAIServer(("127.0.0.1", 0), generator, "tiny")
    thread = threading.Thread(target=srv.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    yield srv
    srv.shutdown()
    srv.server_close()
    thread.join(timeout=10)


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"http://127.0.0.1:{server.server_address[1]}/v1", api_key="unused", max_retries=0)


def _reference_greedy(generator: HFGenerator, ids: list[int], max_new: int) -> str:
    """transformers' own greedy generate, decoded the way the server decodes (up to the first eos)."""
    import torch

    out = generator.model.generate(torch.tensor([ids]), max_new_tokens=max_new, do_sample=False,
                                   eos_token_id=sorted(generator.eos_ids), pad_token_id=generator.tokenizer.pad_token_id)
    new = out[0, len(ids):].tolist()
    for i, t in enumerate(new):
        if t in generator.eos_ids:
            new = new[:i]
            break
    return generator.tokenizer.decode(new, skip_special_tokens=True).rstrip("\ufffd")  # an unfinished character


def test_models_lists_the_served_name(client):
    models = client.models.list()
    assert [m.id for m in models.data] == ["tiny"]


def test_completion_is_transformers_greedy_generation(client, server):
    r = client.completions.create(model="tiny", prompt="1+2=", max_tokens=8, temperature=0)
    gen = server.generator
    assert r.choices[0].text == _reference_greedy(gen, gen.text_prompt("1+2="), 8)
    assert r.choices[0].finish_reason in ("stop", "length")
    assert r.usage.prompt_tokens == len(gen.text_prompt("1+2=")) and 0 < r.usage.completion_tokens <= 8


def test_chat_renders_the_chat_template(client, server):
    messages = [{"role": "user", "content": "What is 3+4?"}]
    r = client.chat.completions.create(model="tiny", messages=messages, max_tokens=6, temperature=0)
    gen = server.generator
    ids = gen.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    ids = list(ids["input_ids"] if hasattr(ids, "keys") else ids)
    assert r.choices[0].message.role == "assistant"
    assert r.choices[0].message.content == _reference_greedy(gen, ids, 6)
    assert r.usage.prompt_tokens == len(ids)


def test_streaming_gives_the_same_text_in_pieces(client):
    kwargs = dict(model="tiny", max_tokens=10, temperature=0.9, seed=7)
    whole = client.completions.create(prompt="5+5=", **kwargs).choices[0].text
    chunks = list(client.completions.create(prompt="5+5=", stream=True, **kwargs))
    assert "".join(c.choices[0].text for c in chunks) == whole
    assert chunks[-1].choices[0].finish_reason in ("stop", "length")

    messages = [{"role": "user", "content": "hi"}]
    whole = client.chat.completions.create(messages=messages, **kwargs).choices[0].message.content
    events = list(client.chat.completions.create(messages=messages, stream=True, **kwargs))
    assert events[0].choices[0].delta.role == "assistant"
    assert "".join(e.choices[0].delta.content or "" for e in events) == whole
    assert events[-1].choices[0].finish_reason in ("stop", "length")


def test_sampling_follows_the_seed(client):
    kwargs = dict(model="tiny", prompt="7+1=", max_tokens=12, temperature=1.0)
    a = client.completions.create(seed=1, **kwargs).choices[0].text
    assert client.completions.create(seed=1, **kwargs).choices[0].text == a
    others = {client.completions.create(seed=s, **kwargs).choices[0].text for s in range(2, 6)}
    assert others - {a}, "different seeds always gave the same sample"


def test_stop_strings_end_the_text_before_them(client):
    kwargs = dict(model="tiny", prompt="9+9=", max_tokens=12, temperature=0)
    full = client.completions.create(**kwargs).choices[0].text
    if len(full) < 3:
        pytest.skip(f"greedy completion too short to cut: {full!r}")
    stop = full[2]
    r = client.completions.create(stop=[stop], **kwargs).choices[0]
    assert r.text == full[: full.index(stop)] and r.finish_reason == "stop"
    streamed = "".join(c.choices[0].text for c in client.completions.create(stop=[stop], stream=True, **kwargs))
    assert streamed == r.text


def test_n_choices_and_prompt_lists(client):
    r = client.completions.create(model="tiny", prompt=["1+1=", "2+2="], n=2, max_tokens=3, temperature=0)
    assert sorted(c.index for c in r.choices) == [0, 1, 2, 3]


def test_bad_requests_get_openai_errors(client):
    with pytest.raises(openai.NotFoundError, match="serves 'tiny'"):
        client.completions.create(model="gpt-4", prompt="x", max_tokens=2)
    with pytest.raises(openai.BadRequestError, match="logprobs"):
        client.completions.create(model="tiny", prompt="x", max_tokens=2, logprobs=2)
    with pytest.raises(openai.BadRequestError, match="temperature"):
        client.completions.create(model="tiny", prompt="x", max_tokens=2, temperature=7)
    with pytest.raises(openai.BadRequestError, match="at most"):
        client.completions.create(model="tiny", prompt="1" * 5000, max_tokens=2)


# ---------------------------------------------------------------------- bounds (issue 47)


def _raw(server, head: str, body: bytes = b"", timeout: float = 15.0) -> socket.socket:
    """A connection to the server that has sent ``head`` (the request line and headers) and ``body``."""
    sock = socket.create_connection(("127.0.0.1", server.server_address[1]), timeout=timeout)
    sock.sendall(head.replace("\n", "\r\n").encode() + b"\r\n" + body)
    return sock


def _answer(sock: socket.socket) -> tuple[int, str, dict]:
    """Status, headers and JSON body of the response on ``sock`` (read up to the connection's close or the body's
    end)."""
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65536)
        assert chunk, f"the connection closed before an answer: {data!r}"
        data += chunk
    head, _, rest = data.partition(b"\r\n\r\n")
    length = int(re.search(rb"Content-Length: (\d+)", head).group(1))
    while len(rest) < length:
        chunk = sock.recv(65536)
        if not chunk:
            break
        rest += chunk
    return int(head.split()[1]), head.decode(), json.loads(rest[:length])


@pytest.mark.timeout(120)
def test_a_large_and_a_slow_request_do_not_hold_up_another_client(server, client, monkeypatch):
    from polyrl.serving import hf_server

    monkeypatch.setattr(hf_server, "BODY_DEADLINE_S", 4.0)
    # 100 MB announced, 64 KiB sent: the 413 comes from Content-Length, before the body is read
    large = _raw(server, "POST /v1/completions HTTP/1.1\nHost: x\nContent-Type: application/json\n"
                 f"Content-Length: {100 << 20}\n", b"x" * (64 << 10))
    # a chunked body that grows past the bound (8 MiB) is refused as soon as it does
    chunked = _raw(server, "POST /v1/completions HTTP/1.1\nHost: x\nTransfer-Encoding: chunked\n")
    # a body that trickles in: 10 of 100 bytes, then nothing
    slow = _raw(server, "POST /v1/completions HTTP/1.1\nHost: x\nContent-Length: 100\n", b'{"model": ')
    started = time.monotonic()
    status, head, doc = _answer(large)
    assert status == 413 and "at most 8388608" in doc["error"]["message"] and "Connection: close" in head
    assert time.monotonic() - started < 5
    refused = None
    for _ in range(16):  # 1 MiB a chunk: refused before the 9th
        try:
            chunked.sendall(b"100000\r\n" + b"y" * (1 << 20) + b"\r\n")
        except OSError:
            break
    refused = _answer(chunked)
    assert refused[0] == 413 and "more than 8388608" in refused[2]["error"]["message"]
    # meanwhile another client is answered at once, while the slow one is still sending
    t0 = time.monotonic()
    r = client.completions.create(model="tiny", prompt="1+1=", max_tokens=2, temperature=0)
    assert r.choices[0].finish_reason in ("stop", "length") and time.monotonic() - t0 < 3.5
    status, head, doc = _answer(slow)  # then the slow one gets its 408 at the deadline
    assert status == 408 and "did not arrive within 4 s" in doc["error"]["message"]
    assert time.monotonic() - started < 15
    for sock in (large, chunked, slow):
        sock.close()


def test_a_prompt_far_over_the_model_length_is_refused_before_tokenizing(client, server, monkeypatch):
    gen = server.generator
    calls = []
    tokenize = type(gen.tokenizer).__call__
    monkeypatch.setattr(type(gen.tokenizer), "__call__", lambda self, *a, **k: calls.append(1) or tokenize(self, *a, **k))
    huge = "7" * (gen.max_prompt_chars + 1)
    t0 = time.monotonic()
    with pytest.raises(openai.BadRequestError, match="characters") as info:
        client.completions.create(model="tiny", prompt=huge, max_tokens=2)
    assert info.value.body["param"] == "prompt" and not calls and time.monotonic() - t0 < 5
    with pytest.raises(openai.BadRequestError, match="characters"):
        client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": huge}], max_tokens=2)
    # between the probe and the character bound only the first characters are tokenized
    from polyrl.serving.hf_server import PROBE_CHARS_PER_TOKEN

    probe = PROBE_CHARS_PER_TOKEN * gen.max_model_len
    assert probe < gen.max_prompt_chars
    seen = []
    monkeypatch.setattr(type(gen.tokenizer), "__call__", lambda self, text, *a, **k: seen.append(len(text))
                        or tokenize(self, text, *a, **k))
    with pytest.raises(openai.BadRequestError, match="alone are"):
        client.completions.create(model="tiny", prompt="7" * (probe + 100), max_tokens=2)
    assert seen == [probe]
    # the bound never refuses a prompt that fits: each token is at most that many characters
    assert gen.max_prompt_chars >= gen.max_model_len * max(len(gen.tokenizer.decode([i])) for i in range(50))


def test_each_bad_request_gets_its_own_clear_error(client, server):
    with pytest.raises(openai.BadRequestError, match="'n' must be an integer from 1 to 16"):
        client.completions.create(model="tiny", prompt="x", max_tokens=2, n=0)
    messages = [{"role": "user", "content": None}]
    with pytest.raises(openai.BadRequestError, match=r"messages\[0\]\.content must be a string .* got null"):
        client.chat.completions.create(model="tiny", messages=messages, max_tokens=2)
    for route, method, allow in (("/v1/completions", "GET", "POST"), ("/v1/chat/completions", "GET", "POST"),
                                 ("/v1/models", "POST", "GET"), ("/v1/completions", "DELETE", "POST")):
        status, head, doc = _answer(_raw(server, f"{method} {route} HTTP/1.1\nHost: x\nContent-Length: 0\n"))
        assert status == 405 and f"Allow: {allow}" in head and f"takes {allow}" in doc["error"]["message"], head
    status, head, doc = _answer(_raw(server, "GET /v1/nothing HTTP/1.1\nHost: x\n"))
    assert status == 404
    body = json.dumps({"prompt": "1+1=", "max_tokens": 2}).encode()
    sock = _raw(server, f"POST /v1/completions HTTP/1.1\nHost: x\nContent-Length: {len(body)}\n", body)
    status, head, doc = _answer(sock)
    assert status == 400 and doc["error"]["param"] == "model" and "must provide a model" in doc["error"]["message"]
    # curl's `Expect: 100-continue` with a body over the bound: refused before it is sent
    sock = _raw(server, f"POST /v1/completions HTTP/1.1\nHost: x\nExpect: 100-continue\nContent-Length: {1 << 30}\n")
    assert _answer(sock)[0] == 413


@pytest.mark.timeout(120)
def test_a_client_that_leaves_mid_answer_is_one_debug_line(server, caplog, capfd, monkeypatch):
    # The model's real stream, held after its first token until the client has gone: otherwise a fast model
    # (or an early eos) can finish the whole answer into the socket's buffer before the reset, and nothing fails.
    gen, left = server.generator, threading.Event()
    real_stream = gen.stream

    def held(*args, **kwargs):
        sent = False  # an event went out (text, or the finish)
        for piece, finish, tokens in real_stream(*args, **kwargs):
            if sent:
                left.wait(60)
            yield piece, finish, tokens
            sent = sent or bool(piece) or finish is not None
        left.wait(60)  # the answer's end ([DONE]) is written after the client left, too

    monkeypatch.setattr(gen, "stream", held)
    body = json.dumps({"model": "tiny", "prompt": "1+", "max_tokens": 120, "temperature": 1.0, "stream": True,
                       "stop": ["never there"]}).encode()
    with caplog.at_level("DEBUG", logger="polyrl.serve"):
        sock = _raw(server, f"POST /v1/completions HTTP/1.1\nHost: x\nContent-Length: {len(body)}\n", body)
        seen = b""
        while b"data: " not in seen:  # the headers, then the first event
            chunk = sock.recv(4096)
            assert chunk, seen
            seen += chunk
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))  # a reset, as a killed client
        sock.close()
        left.set()
        deadline = time.monotonic() + 60
        while not [r for r in caplog.records if "went away" in r.getMessage()] and time.monotonic() < deadline:
            time.sleep(0.1)
    gone = [r for r in caplog.records if "went away" in r.getMessage()]
    assert len(gone) == 1 and gone[0].levelname == "DEBUG", [r.getMessage() for r in caplog.records]
    assert "Traceback" not in capfd.readouterr().err
    assert not [r for r in caplog.records if r.levelno >= 30], [r.getMessage() for r in caplog.records]


# ---------------------------------------------------------------------- the command


def test_serve_a_path_that_is_not_a_model_is_one_line(tmp_path, capsys):
    (tmp_path / "notes.txt").write_text("hello")
    for path in (tmp_path, tmp_path / "notes.txt", tmp_path / "missing"):
        assert main(["serve", str(path), "--backend", "hf", "--port", "0"]) == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and str(path) in err and "checkpoint" in err, err


def test_serve_on_a_port_in_use_is_one_line(tiny_model_dir, capsys):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        assert main(["serve", str(tiny_model_dir), "--backend", "hf", "--port", str(port)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.splitlines() == [f"polyrl serve: error: polyrl serve: port {port} on 127.0.0.1 is in use; choose "
                                "another with --port"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_up(proc: subprocess.Popen, client, timeout: float = 120) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        assert proc.poll() is None, proc.communicate()[1]
        try:
            client.models.list()
            return
        except openai.APIConnectionError:
            time.sleep(0.3)
    raise AssertionError("polyrl serve did not come up")


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_serve_process_answers_then_stops_cleanly(tiny_model_dir, sig):
    port = _free_port()
    env = dict(os.environ, OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false")
    proc = subprocess.Popen([sys.executable, "-m", "polyrl", "serve", str(tiny_model_dir), "--backend", "hf",
                             "--port", str(port)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0)
        _wait_up(proc, client)
        r = client.chat.completions.create(model=tiny_model_dir.name, messages=[{"role": "user", "content": "1+1"}],
                                           max_tokens=4, temperature=0)
        assert r.choices[0].finish_reason in ("stop", "length")
        # bound to loopback only: this machine's other addresses do not answer
        rows = [line.split() for line in Path("/proc/net/tcp").read_text().splitlines()[1:]]
        listening = [r[1] for r in rows if r[1].endswith(f":{port:04X}") and r[3] == "0A"]
        assert listening == [f"0100007F:{port:04X}"], listening
        proc.send_signal(sig)
        out, err = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 0, err
    assert "Traceback" not in err
    # no loading bar, no library warning (transformers' past_key_values rename...): polyrl's own lines only
    from polyrl.testing.console import console_noise

    assert [line for line in console_noise(err) if "hf backend" not in line] == [], err
    assert "slower" in err and err.strip().endswith("polyrl serve: stopped"), err
