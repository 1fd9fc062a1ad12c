"""`sled`: one command line for the server, the device side, benchmarks and the demo."""
from __future__ import annotations

import argparse
import asyncio
import logging
import os
import sys

# OpenMP's default busy-waiting threads starve the server's event loop when the forward runs on
# its engine thread (a tiny batched forward took ~300 ms instead of ~2 ms on 2 cores). This must
# be set before torch loads; an explicit setting in the environment wins.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")


def _add_serve(sub) -> None:
    p = sub.add_parser("serve", help="run the shared verify server")
    p.add_argument("--model", required=True, help="target: local path or HF id (safetensors)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=50051)
    p.add_argument("--metrics-port", type=int, default=None, help="serve Prometheus /metrics here")
    p.add_argument("--dtype", default="float32", help="float32, float64, bfloat16, float16")
    p.add_argument("--device", default="cpu", help="torch device, e.g. cuda:0")
    p.add_argument("--trust-remote-code", action="store_true", help="run the model repo's own code")
    p.add_argument("--max-sessions", type=int, default=256)
    p.add_argument("--max-draft-tokens", type=int, default=32)
    p.add_argument("--max-batch-sessions", type=int, default=64)
    p.add_argument("--context-length", type=int, default=None, help="cap below the model's limit")
    p.add_argument("--kv-budget", default=None,
                   help="KV cache size, e.g. 2GiB or 512MiB (default: --kv-fraction of free memory)")
    p.add_argument("--kv-fraction", type=float, default=0.25,
                   help="KV cache as a fraction of free device memory (default 0.25)")
    p.add_argument("--kv-block-tokens", type=int, default=16, help="tokens per KV block")
    p.add_argument("--max-step-tokens", type=int, default=2048,
                   help="tokens per batched forward; longer prompts are prefilled in chunks")
    p.add_argument("--idle-timeout", type=float, default=300.0,
                   help="seconds a session may idle before its KV is freed (0 = never)")
    p.add_argument("--sat-adapter", default=None,
                   help="SAT adapter (sat_adapter.safetensors) for self-drafting and lookahead "
                        "(default: the one shipped for a built-in target, or one beside the model)")
    p.add_argument("--no-sat", action="store_true", help="serve without semantic adaptive tokens")
    p.add_argument("--engine", default="auto", choices=["auto", "paged", "padded"],
                   help="paged KV fast path, or the generic padded fallback (auto: paged if the "
                        "model supports transformers' attention interface)")
    m = p.add_argument_group("MQTT announcements", "announce this server to devices over MQTT "
                             "(retained on PREFIX/servers/SERVER_ID; off without --mqtt-host)")
    m.add_argument("--mqtt-host", default="", help="broker host")
    m.add_argument("--mqtt-port", type=int, default=None, help="broker port (default 1883, 8883 with TLS)")
    m.add_argument("--mqtt-username", default="")
    m.add_argument("--mqtt-password", default=os.environ.get("SLED_MQTT_PASSWORD", ""),
                   help="(default: $SLED_MQTT_PASSWORD)")
    m.add_argument("--mqtt-tls", action="store_true", help="connect with TLS (system CAs unless "
                   "--mqtt-ca-file)")
    m.add_argument("--mqtt-ca-file", default=None, help="CA bundle for the broker's certificate (implies TLS)")
    m.add_argument("--mqtt-cert-file", default=None, help="client certificate (implies TLS)")
    m.add_argument("--mqtt-key-file", default=None, help="the client certificate's key")
    m.add_argument("--mqtt-topic-prefix", default="sled")
    m.add_argument("--server-id", default=None, help="id in the announcement topic (default: HOSTNAME-PORT)")
    m.add_argument("--announce-endpoint", default=None,
                   help="HOST:PORT devices should dial (default: --host:--port, this machine's "
                        "name for 0.0.0.0)")
    m.add_argument("--announce-interval", type=float, default=5.0, help="seconds between announcements")


def _add_generate(sub) -> None:
    p = sub.add_parser("generate", help="generate on this device, verified by a server")
    p.add_argument("--server", required=True, help="HOST:PORT of a sled server")
    p.add_argument("--drafter", default="ngram",
                   help="ngram, ngram:N, hf:PATH_OR_ID, gguf:ALIAS_OR_FILE, onnx:ALIAS_OR_DIR; or "
                        "server (no drafter: the server generates) or sat (the server drafts with "
                        "its semantic adaptive tokens)")
    p.add_argument("--lookahead", type=int, default=0,
                   help="ask for this many SAT hints per verdict to start the next draft with")
    p.add_argument("--prompt", required=True)
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--draft-len", type=int, default=4, help="tokens drafted per round (k)")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--stop-id", type=int, action="append", default=[], help="extra stop token id")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of text")


def _add_bench(sub) -> None:
    p = sub.add_parser("bench", help="benchmarks")
    bench = p.add_subparsers(dest="bench", required=True)
    o = bench.add_parser("overhead", help="per-round gRPC + scheduling overhead on loopback")
    o.add_argument("--model", default=None, help="target path (default: a tiny random model)")
    o.add_argument("--drafter", default="ngram")
    o.add_argument("--sessions", type=int, default=1, help="concurrent device sessions")
    o.add_argument("--rounds", type=int, default=300, help="rounds per session (at least)")
    o.add_argument("--draft-len", type=int, default=4)
    o.add_argument("--out", default="bench-results/overhead.json")
    a = bench.add_parser("acceptance", help="acceptance and tokens per round per drafter and k")
    a.add_argument("--target", default="gemma3-270m", help="alias or checkpoint path")
    a.add_argument("--drafters", default="gguf:gemma3-270m,onnx:gemma3-270m,ngram",
                   help="comma-separated drafter specs")
    a.add_argument("--k", default="2,4,6,8", help="comma-separated draft lengths")
    a.add_argument("--workload", default="humaneval:20")
    a.add_argument("--max-new-tokens", type=int, default=64)
    a.add_argument("--devices", type=int, default=4, help="concurrent sessions per drafter")
    a.add_argument("--out", default="bench-results/acceptance.json")
    s = bench.add_parser("serve", help="sled vs centralized serving as the number of devices grows")
    s.add_argument("--model", default=None,
                   help="target alias or path (default: the traces' target, else a tiny random one)")
    s.add_argument("--traces", default=None, help="a `sled trace record` file (default: record now)")
    s.add_argument("--drafter", default=None, help="drafter spec to record traces with "
                   "(default: the tiny pair's drafter, or ngram with --model)")
    s.add_argument("--workload", default="humaneval:8", help="humaneval[:N], a prompt file or tiny")
    s.add_argument("--prompts", type=int, default=None, help="use at most this many prompts")
    s.add_argument("--devices", default="1,4,16,64", help="comma-separated fleet sizes")
    s.add_argument("--modes", default="sled,centralized", help="which of sled,centralized to run")
    s.add_argument("--draft-len", default="4", help="tokens drafted per round, or auto (the "
                   "server's suggestion from the previous verdict)")
    s.add_argument("--max-k", type=int, default=8, help="longest draft recorded per position")
    s.add_argument("--max-new-tokens", type=int, default=48)
    s.add_argument("--device-profile", default="pi5",
                   help="pi4, pi5, orin-nano, instant, recorded (this machine's drafting speed); "
                        "NAME:draft_ms_per_token=X,round_overhead_ms=Y overrides")
    s.add_argument("--link", default="wifi", help="loopback, ethernet, wifi, lte; "
                   "NAME:rtt_ms=X,jitter_ms=Y,bandwidth_mbps=Z overrides")
    s.add_argument("--target-rate", type=float, default=10.0,
                   help="tokens/s that 95%% of devices must reach for a fleet size to count")
    s.add_argument("--dtype", default="float32", help="the target's dtype, recording and serving")
    s.add_argument("--server-args", default="", help='extra `sled serve` flags, e.g. "--device cuda"')
    s.add_argument("--out", default="bench-results/serve.json")
    v = bench.add_parser("device", help="adaptive draft length vs fixed k per link, and pipelined "
                         "drafting on vs off per round trip time, on emulated devices")
    v.add_argument("--model", default=None,
                   help="target alias or path (default: the traces' target, else a tiny random one)")
    v.add_argument("--traces", default=None, help="a `sled trace record` file (default: record now)")
    v.add_argument("--drafter", default=None, help="drafter spec to record traces with "
                   "(default: the tiny pair's drafter, or ngram with --model)")
    v.add_argument("--workload", default="humaneval:8", help="humaneval[:N], a prompt file or tiny")
    v.add_argument("--prompts", type=int, default=None, help="use at most this many prompts")
    v.add_argument("--max-k", type=int, default=8, help="longest draft recorded per position")
    v.add_argument("--max-new-tokens", type=int, default=48)
    v.add_argument("--device-profile", default="pi5",
                   help="pi4, pi5, orin-nano, instant; NAME:draft_ms_per_token=X,round_overhead_ms=Y")
    v.add_argument("--devices", type=int, default=1, help="devices running at once")
    v.add_argument("--reps", type=int, default=1, help="passes over the prompts")
    v.add_argument("--parts", default="adaptive,pipeline", help="which of adaptive,pipeline to run")
    v.add_argument("--links", default="ethernet,lte",
                   help="link profiles for the draft-length table (NAME:rtt_ms=X,... overrides)")
    v.add_argument("--k", default="1,2,4,6,8", help="fixed draft lengths to compare adaptive with")
    v.add_argument("--rtts", default="5,20,50", help="round trip times (ms) for the pipelining table")
    v.add_argument("--pipeline-link", default="wifi", help="link whose round trip --rtts sets")
    v.add_argument("--pipeline-draft-len", default="4", help="k for the pipelining table, or adaptive")
    v.add_argument("--min-confidence", type=float, default=0.0,
                   help="stop drafts early below this drafter confidence, every configuration (0: never)")
    v.add_argument("--dtype", default="float32", help="the target's dtype, recording and serving")
    v.add_argument("--server-args", default="", help='extra `sled serve` flags, e.g. "--device cuda"')
    v.add_argument("--out", default="bench-results/device.json")
    e = bench.add_parser("engine", help="paged engine vs the padded fallback as contexts grow")
    e.add_argument("--model", default=None, help="target alias or path (default: a tiny random model)")
    e.add_argument("--dtype", default="float32")
    e.add_argument("--device", default="cpu", help="torch device, e.g. cuda:0")
    e.add_argument("--contexts", default="128,512,2048", help="context tokens per session")
    e.add_argument("--sessions", default="1,8", help="sessions verifying in one step")
    e.add_argument("-k", type=int, default=4, help="draft tokens per session (k)")
    e.add_argument("--block-tokens", type=int, default=16)
    e.add_argument("--reps", type=int, default=5, help="timed steps per engine and cell, interleaved")
    e.add_argument("--out", default="bench-results/engine.json")
    d = bench.add_parser("drafter", help="GGUF/ONNX drafter vs its runtime's own generation loop")
    d.add_argument("--model", required=True, help="gguf:ALIAS, gguf:FILE, onnx:ALIAS or onnx:DIR")
    d.add_argument("--threads", type=int, default=None, help="runtime threads (default: all cores)")
    d.add_argument("--tokens", type=int, default=128, help="tokens generated per run")
    d.add_argument("--draft-len", type=int, default=4, help="tokens drafted per round (k)")
    d.add_argument("--accept", type=int, default=None,
                   help="drafts accepted per simulated verdict (default: all)")
    d.add_argument("--reps", type=int, default=5, help="repetitions of each, interleaved")
    d.add_argument("--out", default=None, help="default: bench-results/drafter-MODEL-tN.json")
    t = bench.add_parser("sdsat", help="SAT self-drafting vs plain decoding, and SAT lookahead "
                         "per drafter, on a SAT-tuned target")
    t.add_argument("--model", default="gemma3-270m", help="target alias or checkpoint path")
    t.add_argument("--sat-adapter", default=None, help="SAT adapter for the server (default: the "
                   "one shipped for a built-in target, or one beside the model)")
    t.add_argument("--workload", default="humaneval:10", help="humaneval[:N], a prompt file or tiny")
    t.add_argument("--max-new-tokens", type=int, default=64)
    t.add_argument("--drafters", default="gguf:gemma3-270m,onnx:gemma3-270m,ngram",
                   help="comma-separated drafter specs for the lookahead part")
    t.add_argument("--k", type=int, default=4, help="tokens drafted per round")
    t.add_argument("--lookahead", type=int, default=None,
                   help="SAT hints per verdict (default: the target's SAT slots)")
    t.add_argument("--devices", type=int, default=1, help="sessions at once in every mode")
    t.add_argument("--dtype", default="float32", help="the target's dtype on the server")
    t.add_argument("--server-args", default="", help='extra `sled serve` flags, e.g. "--device cuda"')
    t.add_argument("--out", default="bench-results/sdsat.json")


def _add_trace(sub) -> None:
    p = sub.add_parser("trace", help="drafter traces for emulated devices")
    actions = p.add_subparsers(dest="action", required=True)
    r = actions.add_parser("record", help="record a drafter's proposals along the target's greedy output")
    r.add_argument("--model", default=None, help="target alias or path (default: a tiny random one)")
    r.add_argument("--drafter", default=None, help="ngram, hf:PATH, gguf:ALIAS, onnx:ALIAS "
                   "(default: the tiny pair's drafter, or ngram with --model)")
    r.add_argument("--workload", default="humaneval:8", help="humaneval[:N], a prompt file or tiny")
    r.add_argument("--prompts", type=int, default=None, help="use at most this many prompts")
    r.add_argument("--max-new-tokens", type=int, default=48)
    r.add_argument("--max-k", type=int, default=8, help="tokens proposed per position")
    r.add_argument("--dtype", default="float32", help="the target's dtype")
    r.add_argument("--out", required=True, help="trace file (.jsonl)")


def _add_demo(sub) -> None:
    p = sub.add_parser("demo", help="loopback demo: a server and three devices on this machine")
    p.add_argument("--max-new-tokens", type=int, default=48)
    p.add_argument("--prompts", type=int, default=3, help="HumanEval prompts per device")


def _add_models(sub) -> None:
    p = sub.add_parser("models", help="built-in offline models")
    actions = p.add_subparsers(dest="action", required=True)
    actions.add_parser("list", help="aliases, their packages and cached conversions")
    prepare = actions.add_parser("prepare", help="assemble, convert (and export) ahead of use")
    prepare.add_argument("aliases", nargs="*", help="default: all")
    prepare.add_argument("--onnx", action="store_true", help="also export an int4 ONNX drafter")


def _add_run_device(sub) -> None:
    p = sub.add_parser("run-device", help="run a workload as one device; JSON lines of progress")
    p.add_argument("--server", required=True)
    p.add_argument("--drafter", default="ngram")
    p.add_argument("--workload", default="humaneval:3", help="humaneval[:N] or a prompt file")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--draft-len", type=int, default=4)
    p.add_argument("--name", default="device")


def _add_export_onnx(sub) -> None:
    p = sub.add_parser("export-onnx", help="export an HF checkpoint or built-in model to ONNX (drafter)")
    p.add_argument("source", help="HF checkpoint folder, or a built-in model alias")
    p.add_argument("out", nargs="?", default=None,
                   help="output folder (default for an alias: the cache onnx:ALIAS loads)")
    p.add_argument("--precision", default="int4", choices=["int4", "int8", "fp32"])
    p.add_argument("--execution-provider", default="cpu", help="onnxruntime-genai EP (cpu)")


def _add_sdsat(sub) -> None:
    p = sub.add_parser("sdsat", help="semantic adaptive tokens: the target drafts for itself")
    actions = p.add_subparsers(dest="action", required=True)
    t = actions.add_parser("train", help="train SATs into a causal LM (an adapter, or all weights)")
    t.add_argument("--model", required=True, help="built-in alias or checkpoint path")
    t.add_argument("--corpus", required=True,
                   help="humaneval[:N], a .jsonl (text, or prompt + completion), a text file, "
                        "or a directory of .py files")
    t.add_argument("--out", required=True, help="folder for the adapter, log, plot (full: model)")
    t.add_argument("--mode", default="embeddings", choices=["embeddings", "full", "lora"],
                   help="embeddings: model frozen, only the SAT embeddings train (standard tokens "
                        "bit-identical); full: all weights + a KL term on standard tokens")
    t.add_argument("--slots", type=int, default=4, help="SAT slots m (tokens drafted per pass)")
    t.add_argument("--steps", type=int, default=300)
    t.add_argument("--batch", type=int, default=4, help="examples per step (they share one cut)")
    t.add_argument("--seq-len", type=int, default=256, help="longest token sequence")
    t.add_argument("--lr", type=float, default=None, help="Adam lr (default: 3e-2 embeddings, 1e-5 full)")
    t.add_argument("--kl-weight", type=float, default=1.0, help="full mode: weight of the KL term")
    t.add_argument("--seed", type=int, default=0)
    t.add_argument("--heldout", type=float, default=0.1, help="fraction of sequences held out")
    t.add_argument("--eval-every", type=int, default=None, help="default: steps / 20")
    t.add_argument("--eval-samples", type=int, default=64, help="held-out cuts per evaluation")
    t.add_argument("--save-every", type=int, default=0, help="checkpoint every N steps (0: never)")
    t.add_argument("--resume", action="store_true", help="continue from the checkpoint")
    t.add_argument("--checkpoint-dir", default=None, help="default: OUT/checkpoint")
    t.add_argument("--keep-checkpoint", action="store_true",
                   help="keep the checkpoint after a finished run (default: removed)")
    t.add_argument("--dtype", default="float32", help="float32, float64, bfloat16, float16")


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="sled", description=__doc__)
    p.add_argument("-v", "--verbose", action="store_true")
    sub = p.add_subparsers(dest="command", required=True)
    _add_serve(sub)
    _add_generate(sub)
    _add_bench(sub)
    _add_demo(sub)
    _add_export_onnx(sub)
    _add_models(sub)
    _add_run_device(sub)
    _add_trace(sub)
    _add_sdsat(sub)
    sub.add_parser("device", add_help=False,
                   help="the device daemon: local OpenAI-compatible API, MQTT, drafting "
                        "(sled device --config FILE; sled device --help lists its settings)")
    t = sub.add_parser("make-tiny", help="write a tiny random target + drafter pair (testing)")
    t.add_argument("folder")
    t.add_argument("--arch", default="llama", choices=["llama", "gemma3"])
    return p


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["device"]:   # its flags are its settings' keys (edge_client.settings)
        from sled_cli.device import run_device_daemon
        return run_device_daemon(argv[1:])
    args = parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose or args.command == "serve" else logging.WARNING,
                        format="%(asctime)s %(name)s %(levelname)s %(message)s")
    if args.command == "serve":
        from sled_cli.serve import run_serve
        return run_serve(args)
    if args.command == "generate":
        from sled_cli.generate import run_generate
        return asyncio.run(run_generate(args))
    if args.command == "bench" and args.bench == "acceptance":
        from lab.bench.acceptance import run_acceptance
        return asyncio.run(run_acceptance(args))
    if args.command == "bench" and args.bench == "sdsat":
        from lab.bench.sdsat import run_bench_sdsat
        return asyncio.run(run_bench_sdsat(args))
    if args.command == "bench" and args.bench == "serve":
        from lab.bench.serve import run_bench_serve
        return asyncio.run(run_bench_serve(args))
    if args.command == "bench" and args.bench == "device":
        from lab.bench.device import run_bench_device
        return asyncio.run(run_bench_device(args))
    if args.command == "trace":
        from lab.traces.record import run_trace_record
        return run_trace_record(args)
    if args.command == "bench" and args.bench == "engine":
        from lab.bench.engine import run_engine_bench
        return run_engine_bench(args)
    if args.command == "bench" and args.bench == "drafter":
        from lab.bench.drafter import run_drafter_bench
        return run_drafter_bench(args)
    if args.command == "bench":
        from lab.bench.overhead import run_overhead
        return asyncio.run(run_overhead(args))
    if args.command == "demo":
        from lab.demo import run_demo
        return asyncio.run(run_demo(args))
    if args.command == "models":
        from sled_cli.models import run_models
        return run_models(args)
    if args.command == "run-device":
        from lab.device_runner import run_device
        return asyncio.run(run_device(args))
    if args.command == "export-onnx":
        from sled_cli.export_onnx import run_export_onnx
        return run_export_onnx(args)
    if args.command == "sdsat":
        from verify_server.sdsat_train import run_sdsat_train
        return run_sdsat_train(args)
    if args.command == "make-tiny":
        from lab.tiny import save_pair
        for path in save_pair(args.folder, args.arch):
            print(path)
        return 0
    return 2


if __name__ == "__main__":
    sys.exit(main())
