"""`sled device` as a person runs it: a config file, the local OpenAI-compatible API, and a
verify server that is killed and restarted while requests stream."""
from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import urllib.request

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from conftest import SLED, run_sled
from lab.server_process import free_port


def test_bad_config_stops_start_up_naming_the_key(tmp_path):
    config = tmp_path / "device.toml"
    config.write_text('servers = ["127.0.0.1:50051"]\nmax_sesions = 4\n[policy]\ndraft_len = "fast"\n')
    done = run_sled("device", "--config", str(config), timeout=60)
    assert done.returncode == 2
    assert "max_sesions: unknown key" in done.stderr
    assert "policy.draft_len" in done.stderr and "'fast'" in done.stderr
    flagged = run_sled("device", "--config", str(config.with_name("missing.yaml")), timeout=60)
    assert flagged.returncode == 2 and "missing.yaml does not exist" in flagged.stderr
    env_bad = subprocess.run([*SLED, "device", "--port", "8001"], capture_output=True, text=True,
                             timeout=60, env={**os.environ, "SLED_DEVICE_MQTT__PORT": "-3"})
    assert env_bad.returncode == 2 and "mqtt.port" in env_bad.stderr


def start_server(model_dir, port: int) -> subprocess.Popen:
    return subprocess.Popen([*SLED, "serve", "--model", str(model_dir), "--dtype", "float64",
                             "--port", str(port)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


async def wait_health(port: int, timeout: float = 120.0) -> dict:
    """The device's /health once it says ready."""
    deadline = asyncio.get_running_loop().time() + timeout
    while True:
        try:
            body = await asyncio.to_thread(
                lambda: urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2).read())
            status = json.loads(body)
            if status["state"] == "ready":
                return status
        except OSError:
            pass
        if asyncio.get_running_loop().time() > deadline:
            raise TimeoutError("sled device never became ready")
        await asyncio.sleep(0.3)


def device_metric(port: int, name: str) -> float:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    return sum(float(line.split()[-1]) for line in text.splitlines() if line.startswith(name))


async def test_streams_survive_a_server_kill_and_restart(pair, tmp_path, monkeypatch):
    """SIGKILL the verify server while four streaming requests are running, start it again on
    the same port: every request completes with exactly the target's greedy output."""
    openai = pytest.importorskip("openai")
    monkeypatch.setenv("SLED_CACHE", str(tmp_path / "cache"))
    target_dir, drafter_dir = pair
    server_port, api_port = free_port(), free_port()
    config = tmp_path / "device.yaml"
    config.write_text(f"id: pi-test\nservers: ['127.0.0.1:{server_port}']\ndrafter: 'hf:{drafter_dir}'\n"
                      f"port: {api_port}\nmodel_name: tiny\nreconnect_s: 120\npolicy:\n  draft_len: 1\n")
    server = start_server(target_dir, server_port)
    device = subprocess.Popen([*SLED, "device", "--config", str(config)], stdout=subprocess.DEVNULL,
                              stderr=subprocess.PIPE, env={**os.environ})
    prompts = ["def fib(n):", "for i in range(10):", "The server verifies", "import math"]
    max_tokens = 160
    try:
        await wait_health(api_port)
        client = openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{api_port}/v1", api_key="none",
                                    timeout=180)
        first_chunk = [asyncio.Event() for _ in prompts]

        async def stream(i: int) -> str:
            text = ""
            response = await client.completions.create(
                model="tiny", prompt=prompts[i], max_tokens=max_tokens, stream=True, temperature=0,
                extra_body={"ignore_eos": True})
            async for chunk in response:
                text += chunk.choices[0].text
                first_chunk[i].set()
            return text

        tasks = [asyncio.create_task(stream(i)) for i in range(len(prompts))]
        await asyncio.wait_for(asyncio.gather(*(e.wait() for e in first_chunk)), 120)
        assert not any(t.done() for t in tasks), "the requests finished before the server was killed"
        server.send_signal(signal.SIGKILL)
        server.wait()
        await asyncio.sleep(0.5)
        server = start_server(target_dir, server_port)
        texts = await asyncio.wait_for(asyncio.gather(*tasks), 240)
        resumes = device_metric(api_port, "sled_device_resumes_total")
    finally:
        server.kill()
        device.send_signal(signal.SIGTERM)
        try:
            device.wait(20)
        except subprocess.TimeoutExpired:
            device.kill()
    tokenizer = AutoTokenizer.from_pretrained(target_dir)
    model = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float64).eval()
    for prompt, text in zip(prompts, texts):
        ids = tokenizer(prompt).input_ids
        reference = model.generate(torch.tensor([ids]), max_new_tokens=max_tokens, do_sample=False,
                                   pad_token_id=tokenizer.pad_token_id)[0, len(ids):].tolist()
        assert text == tokenizer.decode(reference, skip_special_tokens=True)
    assert resumes >= len(prompts)
    assert device.returncode == 0, device.stderr.read().decode()[-2000:]
