"""The demo's last table: the same kind of fleet against an emulated H100 serving an 8B model.

The demo's real run puts a CPU target beside its drafters on one small machine, where serving
centrally wins. What the design is for is a GPU whose batched step costs about the same for one
device or many. This part asks what that GPU would do, without one:

- the server is the tiny random target held to the step times of a step-cost profile
  (`sled serve --emulate h100-llama8b-hf-graph`): it still computes every token, so every output
  is still checked against the server's own;
- each emulated device replays a synthetic trace (lab.traces.synthetic) whose acceptance is the
  one its drafter reached in the real run, at a Pi 5's drafting pace (an assumption,
  lab.profiles), over the wifi link profile;
- centralized serving runs the same requests through the same emulated server.

The fleets are the demo's three devices and 512 devices like them (a fleet that loads the GPU;
`sled demo --emulated-devices N` sets it).
The result is labelled as emulated everywhere, with the profile's provenance and the steps that
overran it.
"""
from __future__ import annotations

from dataclasses import dataclass
from types import SimpleNamespace

import numpy as np
from rich.table import Table

from edge_client.server_side import generate_server_side
from edge_client.wire import SessionRequest
from lab.bench.harness import serving
from lab.bench.serve import emulation_lines, emulation_summary, sweep
from lab.profiles import device_profile, link_profile
from lab.tiny import cached_pair
from lab.traces.format import TraceSet
from lab.traces.synthetic import profile_for_share, synthetic_trace
from verify_server.step_costs import load_profile

PROFILE = "h100-llama8b-hf-graph"
FLEETS = (3, 512)
DEVICE, LINK = "pi5", "wifi"
DRAFT_LEN, MAX_K = 4, 8
# a server configured for the fleet: every device's session in one step, as a GPU server would be
SERVER_ARGS = ("--max-batch-sessions", "512", "--max-step-tokens", "4096",
               "--max-streams-per-device", "1024", "--max-sessions", "1024")


@dataclass
class EmulatedRun:
    rows: list[dict]           # lab.bench.serve.summarize() per (fleet size, mode)
    profile: object            # the verify_server.step_costs.StepProfile held to
    summary: dict              # lab.bench.serve.emulation_summary(): steps, overruns, valid


async def run_emulated(acceptance: dict[str, float], prompts: list[str],
                       max_new_tokens: int, fleets=FLEETS, console=None) -> EmulatedRun:
    """Both modes at every fleet size, through `sled bench serve`'s sweep; acceptance: drafter
    name -> the share of its drafted tokens the target accepted."""
    async with serving(cached_pair()[0], ["--emulate", PROFILE, *SERVER_ARGS], console,
                       status=f"starting a server emulating {PROFILE}") as served:
        traces = TraceSet(served.info.model_id, "demo drafters", MAX_K,
                          await _traces(served, acceptance, prompts, max_new_tokens),
                          served.fingerprint)
        args = SimpleNamespace(max_new_tokens=max_new_tokens, draft_len=DRAFT_LEN,
                               emulate=PROFILE)
        rows = await sweep(served, traces, sorted(set(fleets)), ["sled", "centralized"], args,
                           device_profile(DEVICE), link_profile(LINK), console)
    profile = load_profile(PROFILE)
    return EmulatedRun(rows, profile, emulation_summary(profile, rows))


async def _traces(served, acceptance: dict[str, float], prompts: list[str], max_new: int):
    """One synthetic trace per prompt and drafter, interleaved so that device j of a fleet
    drafts like drafter j mod len(acceptance), along the server's own output. A drafter's
    accepted share becomes the per-position acceptance that keeps that share of a k-token
    draft (lab.traces.synthetic.profile_for_share)."""
    rng = np.random.default_rng(0)
    traces = []
    for prompt in await served.prompt_ids(prompts):
        request = SessionRequest(prompt, max_new_tokens=max_new)
        output = (await generate_server_side(served.stub, request)).token_ids
        for name, share in acceptance.items():
            traces.append(synthetic_trace(prompt, output, profile_for_share(share, DRAFT_LEN),
                                          MAX_K, served.info.vocab_size, rng, drafter=name))
    return traces


def emulated_table(run: EmulatedRun):
    table = Table(title=f"EMULATED: the same kind of fleet against an H100 serving an 8B model "
                        f"({PROFILE}); devices at a Pi 5's pace over wifi")
    for column in ("", "devices", "tok/s, all", "tok/s per device (p50)", "passes/token",
                   "outputs"):
        table.add_column(column, justify="right" if column else "left")
    for row in run.rows:
        ratio = row.get("throughput_vs_centralized")
        table.add_row(row["mode"] + (f" ({ratio:.2f}x)" if ratio else ""), str(row["devices"]),
                      f"{row['throughput']:.1f}", f"{row['device_tps_p50']:.1f}",
                      f"{row['passes_per_token']:.3f}",
                      "identical" if not row["mismatches"] else f"{row['mismatches']} DIFFERENT")
    return table


def emulated_notes(run: EmulatedRun) -> list[str]:
    return [*emulation_lines(run.profile, run.summary),
            "each emulated device keeps the share of its drafts its drafter kept above; the "
            "server is a tiny random target held to the H100's step times, so these outputs "
            "are checked against that target's own"]
