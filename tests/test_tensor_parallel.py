"""`sled serve --tp 2`: one server split over two processes (gloo on this CPU), each holding half
of a tiny Llama's attention and KV heads. Its outputs are the unsplit target's: greedy output
equals generate(do_sample=False) for chains, trees and 8 concurrent sessions, and seeded
sampling repeats the --tp 1 server token for token. A model that does not split is refused in
one line before any rank starts. Its ranks listen off loopback on no port but those it was
given, and meet in a store only the server's user can open (more: tests/test_rank_isolation.py)."""
from __future__ import annotations

import asyncio
import dataclasses
import ipaddress
import json
import os
import signal
import subprocess
import sys

import grpc
import psutil
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, GPT2Config, GPT2LMHeadModel

from conftest import PROMPT_TEXTS, greedy_reference, zombie_or_gone
from drafters.hf import HFDrafter
from drafters.ngram import NgramDrafter
from edge_client.server_side import generate_server_side
from edge_client.session import RoundSettings, generate
from edge_client.transport import VerifyError
from edge_client.wire import SessionRequest
from lab.server_process import ServerProcess, free_port
from sled.v1 import verifier_pb2 as pb
from sled.v1 import verifier_pb2_grpc as pb_grpc
from sled.wire.sampling import Sampling
from verify_server.engines.blocks import BlockPool, KVShape
from verify_server import ranks
from verify_server.rendezvous import STORE_KEY
from verify_server.sdsat import save_adapter
from verify_server.target import check_splittable

NEW_TOKENS = 24
SEEDS = 12


@pytest.fixture(scope="module")
def checkpoint(pair):
    target_dir, drafter_dir = pair
    model = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()
    drafter = AutoModelForCausalLM.from_pretrained(drafter_dir, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(target_dir)
    prompts = [tokenizer(text).input_ids for text in PROMPT_TEXTS]
    return target_dir, model, drafter, tokenizer, prompts


@pytest.fixture(scope="module")
async def split_server(checkpoint):
    async with ServerProcess(str(checkpoint[0]), "--tp", "2", "--kv-budget", "64MiB",
                             "--max-sessions", "32") as server:
        yield server


async def run(address: str, drafter, prompt, *, tree: int = 1, sampling: Sampling = Sampling()):
    async with grpc.aio.insecure_channel(address) as channel:
        result = await generate(pb_grpc.VerifierStub(channel), drafter,
                                SessionRequest(prompt, max_new_tokens=NEW_TOKENS, ignore_eos=True,
                                               sampling=sampling),
                                settings=RoundSettings(draft_len=4, tree=tree))
    return result.token_ids


async def test_chains_and_trees_of_8_concurrent_sessions_are_the_targets_greedy_output(
        split_server, checkpoint):
    _, model, drafter_model, tokenizer, prompts = checkpoint
    cases = [(prompts[i % len(prompts)], tree) for i, tree in enumerate([1, 3] * 4)]
    got = await asyncio.gather(*(
        run(split_server.address, HFDrafter(drafter_model, tokenizer), prompt, tree=tree)
        for prompt, tree in cases))
    for (prompt, tree), tokens in zip(cases, got):
        assert tokens == greedy_reference(model, prompt, NEW_TOKENS), f"tree={tree}"
    assert split_server.metric("sled_forward_passes_total") > 0
    # --kv-budget is the whole server's: the blocks one device would hold, half on each rank
    blocks = (64 << 20) // (16 * KVShape.of(model).bytes_per_token) - 1
    assert split_server.metric("sled_kv_blocks_total") == blocks


async def test_seeded_sampling_repeats_the_unsplit_server(split_server, checkpoint, serve):
    _, model, _, tokenizer, prompts = checkpoint
    whole = await serve(model, tokenizer=tokenizer)
    sampling = [Sampling(temperature=1.0, top_k=12, seed=seed) for seed in range(SEEDS)]
    split = await asyncio.gather(*(run(split_server.address, NgramDrafter(), prompts[0],
                                       sampling=s) for s in sampling))
    unsplit = await asyncio.gather(*(run(whole.address, NgramDrafter(), prompts[0], sampling=s)
                                     for s in sampling))
    assert split == unsplit
    assert len({tuple(tokens) for tokens in split}) > 1    # the seeds did sample


def test_the_ranks_listen_only_on_loopback_and_meet_in_a_store_that_is_gone(split_server):
    """Rank 0 and its child: no listener off loopback but the ports sled serve was given (the
    ranks' own sockets are gloo's, on loopback, and nothing else of theirs leaves it); they met
    in a file store, not on a TCP one, and rank 0 removed it once they had."""
    rank_0 = psutil.Process(split_server.proc.pid)
    follower, = rank_0.children()
    named = {split_server.port, split_server.metrics_port}
    listening = [(process.pid, c.laddr) for process in (rank_0, follower)
                 for c in process.net_connections("tcp") if c.status == psutil.CONN_LISTEN]
    assert [(pid, address) for pid, address in listening
            if address.port not in named and not _loopback(address.ip)] == []
    assert any(pid == follower.pid for pid, _ in listening)     # gloo's, on loopback
    talking = [c for c in follower.net_connections("tcp") if c.raddr]
    assert talking and all(_loopback(c.laddr.ip) and _loopback(c.raddr.ip) for c in talking)
    environment = follower.environ()
    assert "MASTER_PORT" not in environment and environment["GLOO_SOCKET_IFNAME"] == "lo"
    assert not os.path.exists(os.path.dirname(environment[STORE_KEY]))


def _loopback(ip: str) -> bool:
    address = ipaddress.ip_address(ip)
    return (getattr(address, "ipv4_mapped", None) or address).is_loopback


async def test_the_flex_engine_runs_on_every_rank(checkpoint):
    """Flex per rank (warmed up, compiled on this CPU): a chain and a tree as greedy generate."""
    _, model, drafter_model, tokenizer, prompts = checkpoint
    async with ServerProcess(str(checkpoint[0]), "--tp", "2", "--engine", "flex",
                             "--kv-budget", "16MiB", "--max-sessions", "4") as server:
        got = await asyncio.gather(*(run(server.address, HFDrafter(drafter_model, tokenizer),
                                         prompts[1], tree=tree) for tree in (1, 3)))
    assert got == [greedy_reference(model, prompts[1], NEW_TOKENS)] * 2


async def test_sat_self_drafting_and_hints_on_a_split_target(checkpoint, tmp_path):
    """SAT slots written into a split model's embeddings: self-drafting and lookahead hints
    (the target's SAT guesses) leave the output the target's greedy output."""
    target_dir, model, drafter_model, tokenizer, prompts = checkpoint
    rows = torch.tensor([[11, 57, 203]])
    adapter = save_adapter(tmp_path / "sat.safetensors",
                           model.get_input_embeddings()(rows)[0].detach(), {"base": "tiny"})
    async with ServerProcess(str(target_dir), "--tp", "2", "--sat-adapter", str(adapter),
                             "--kv-budget", "16MiB") as server:
        async with grpc.aio.insecure_channel(server.address) as channel:
            stub = pb_grpc.VerifierStub(channel)
            request = SessionRequest(prompts[2], max_new_tokens=NEW_TOKENS, ignore_eos=True)
            own = await generate_server_side(stub, dataclasses.replace(
                request, mode=pb.GENERATION_MODE_SERVER_SAT))
            hinted = await generate(stub, HFDrafter(drafter_model, tokenizer), request,
                                    settings=RoundSettings(draft_len=3, lookahead=2, hints="always"))
    reference = greedy_reference(model, prompts[2], NEW_TOKENS)
    assert own.token_ids == reference and hinted.token_ids == reference
    assert hinted.hint_tokens > 0          # the SAT guesses came back from both ranks' pass


def test_a_sat_adapter_with_lora_deltas_is_refused(checkpoint, tmp_path):
    from test_sat_lora import random_lora

    model = checkpoint[1]
    adapter = save_adapter(tmp_path / "sat.safetensors",
                           model.get_input_embeddings()(torch.tensor([[11, 57]]))[0].detach(),
                           {"base": "tiny"}, lora=random_lora(model))
    done = sled_serve("--model", str(checkpoint[0]), "--tp", "2", "--sat-adapter", str(adapter))
    assert done.returncode == 2, done.stderr[-2000:]
    assert done.stderr.strip().splitlines()[-1] == (
        f"sled serve: the SAT adapter {adapter} carries LoRA deltas, which sled does not apply "
        "to a model split over ranks: serve it with --tp 1, or with --no-sat")
    assert "Traceback" not in done.stderr


def torchrun(*args: str) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "-m",
            "sled_cli.main", *args]


async def test_under_torchrun_every_rank_is_started_by_torchrun(checkpoint):
    target_dir, model, _, _, prompts = checkpoint
    port = free_port()
    child = subprocess.Popen(torchrun("serve", "--model", str(target_dir), "--tp", "2",
                                      "--port", str(port), "--kv-budget", "16MiB"),
                             stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        address = f"127.0.0.1:{port}"
        async with grpc.aio.insecure_channel(address) as channel:
            await asyncio.wait_for(channel.channel_ready(), 120)
        assert await run(address, NgramDrafter(), prompts[0]) == \
            greedy_reference(model, prompts[0], NEW_TOKENS)
    finally:
        child.terminate()
        said = child.communicate(timeout=30)[1]
    # torchrun's store is open to whoever reaches it: rank 0 says where, once
    assert said.count("the ranks meet on torchrun's store at ") == 1, said[-3000:]


def test_torchrun_with_another_process_count_is_refused(checkpoint):
    done = subprocess.run(torchrun("serve", "--model", str(checkpoint[0]), "--tp", "1",
                                   "--port", "0"), capture_output=True, text=True, timeout=120)
    assert done.returncode != 0
    assert ("sled serve: torchrun started 2 processes for --tp 1: give torchrun "
            "--nproc-per-node 1, or sled serve --tp 2") in done.stderr


def test_a_ranks_pool_holds_its_kv_heads_and_counts_the_whole_server():
    split = BlockPool(KVShape(2, 8, 16, torch.float32, shards=4), 10, 16)
    whole = BlockPool(KVShape(2, 8, 16, torch.float32), 10, 16)
    assert split.keys[0].shape == (160, 2, 16) and whole.keys[0].shape == (160, 8, 16)
    assert split.nbytes == whole.nbytes and split.capacity_tokens == whole.capacity_tokens


@pytest.mark.parametrize("device, gpus, said", [
    ("cuda", 1, "--tp 2 needs 2 GPUs on this machine; it shows 1"),
    ("cpu", 2, "--tp 2 --device cpu on a machine with GPUs would split the model over them: "
               "give --device cuda, or hide them with CUDA_VISIBLE_DEVICES="),
])
def test_devices_that_cannot_hold_the_ranks_are_refused_before_any_starts(monkeypatch, device,
                                                                          gpus, said):
    monkeypatch.setattr(torch.cuda, "device_count", lambda: gpus)
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    started = []
    monkeypatch.setattr(ranks, "_start_children", lambda *a: started.append(a))
    with pytest.raises(ValueError) as refused:
        ranks.start_ranks(2, device, ["serve"])
    assert str(refused.value) == said and not started


def sled_serve(*flags: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "sled_cli.main", "serve", "--port", "0", *flags],
                          capture_output=True, text=True, timeout=timeout)


def test_kv_heads_that_do_not_divide_are_refused_in_one_line(checkpoint):
    done = sled_serve("--model", str(checkpoint[0]), "--tp", "3")
    assert done.returncode == 2
    said = done.stderr.strip().splitlines()     # after the progress line of the target
    assert said[-1] == (f"sled serve: {checkpoint[0]} has 4 attention heads and 2 KV heads, "
                        "which do not split over --tp 3: use --tp 1 or 2")
    assert len(said) <= 2 and "Traceback" not in done.stderr


def test_a_model_without_a_tensor_parallel_plan_is_refused(tmp_path):
    GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64)).save_pretrained(tmp_path)
    with pytest.raises(ValueError, match=r"\(gpt2\) has no tensor-parallel plan in transformers: "
                                         r"serve it with --tp 1"):
        check_splittable(str(tmp_path), 2)


def test_a_synthetic_target_is_refused():
    done = sled_serve("--model", "synthetic:gemma3-1b", "--tp", "2")
    assert done.returncode == 2
    assert "cannot be split over ranks: give --tp 1, or a checkpoint" in done.stderr


async def test_the_other_rank_goes_with_rank_0(checkpoint):
    async with ServerProcess(str(checkpoint[0]), "--tp", "2", "--kv-budget", "16MiB") as server:
        pid = server.proc.pid
        children = _children(pid)
        assert len(children) == 1
        os.kill(pid, signal.SIGKILL)
        server.proc.wait(10)
        for _ in range(100):
            if zombie_or_gone(children[0]):
                break
            await asyncio.sleep(0.1)
        else:
            pytest.fail("rank 1 outlived its rank 0")


def sled_bench_engine(*flags: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "sled_cli.main", "bench", "engine", *flags],
                          capture_output=True, text=True, timeout=300)


def test_the_engine_bench_times_a_split_step_against_one_device(checkpoint, tmp_path):
    out = tmp_path / "split.json"
    done = sled_bench_engine("--model", str(checkpoint[0]), "--tp", "2", "--engines", "paged",
                             "--sessions", "1,3", "--contexts", "40", "--reps", "2",
                             "--out", str(out))
    assert done.returncode == 0, done.stderr[-2000:]
    results = json.loads(out.read_text())
    assert results["tp"] == 2 and [c["sessions"] for c in results["cells"]] == [1, 3]
    assert results["forward"] == "sled"        # the decoder over each rank's shards
    for cell in results["cells"]:
        assert cell["one_ms_p50"] > 0 and cell["split_ms_p50"] > 0
        assert cell["emitted_agree"] == f"{cell['sessions']}/{cell['sessions']}"
    assert "split over 2 ranks" in done.stdout


def test_the_split_bench_refuses_what_it_cannot_time(checkpoint):
    done = sled_bench_engine("--model", str(checkpoint[0]), "--tp", "2", "--engines",
                             "paged,padded")
    assert done.returncode == 2
    assert "give --engines paged or flex" in done.stderr
    done = sled_bench_engine("--shape", "tiny-llama", "--tp", "2", "--engines", "paged")
    assert done.returncode == 2 and "splits a checkpoint: give --model" in done.stderr


def _children(pid: int) -> list[int]:
    return [int(p) for p in open(f"/proc/{pid}/task/{pid}/children").read().split()]


async def test_a_rank_lost_ends_the_server_at_its_next_step(checkpoint):
    """Rank 1 killed: rank 0's next step cannot run on its own, so it exits (70) with a line
    that says why, and the device's call ends UNAVAILABLE (a lost server: it resumes)."""
    _, _, _, _, prompts = checkpoint
    async with ServerProcess(str(checkpoint[0]), "--tp", "2", "--kv-budget", "16MiB") as server:
        follower, = _children(server.proc.pid)
        os.kill(follower, signal.SIGKILL)
        with pytest.raises(VerifyError) as lost:
            await run(server.address, NgramDrafter(), prompts[0])
        assert lost.value.code == grpc.StatusCode.UNAVAILABLE
        assert await asyncio.to_thread(server.proc.wait, 30) == 70
        assert "its ranks may no longer agree, so this process ends (exit 70)" in \
            server.child.tail(4000)


async def test_ctrl_c_stops_both_ranks(checkpoint):
    async with ServerProcess(str(checkpoint[0]), "--tp", "2", "--kv-budget", "16MiB") as server:
        follower, = _children(server.proc.pid)
        os.kill(server.proc.pid, signal.SIGINT)
        assert await asyncio.to_thread(server.proc.wait, 30) == 130
        assert zombie_or_gone(follower)
        assert "Traceback" not in server.child.tail(4000)


