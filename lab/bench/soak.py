"""`sled bench soak`: a fleet of real device daemons against one server for minutes, with fault
steps, watching for what only time shows: memory that keeps growing, errors, round latency that
drifts, tokens lost or duplicated when something fails.

The run is a lab scenario made from the flags (lab.scenario): --devices `sled device` processes
(n-gram drafter, --device-profile and --link emulated) against the tiny random target (or
--model), a real Mosquitto, requests over MQTT for --minutes (closed loop, or Poisson arrivals at
--rate per device), every output checked against the target's greedy output (lab.drive), and
with --faults three fault steps early in the run: the server SIGKILLed and restarted, the broker
restarted, dev-00's link cut for 10 s (lab.faults). Beside the lab's own sampling (lab.scrape)
the soak samples every few seconds the RSS of the server and of every device process (lab.rss)
and the devices' round-trip histograms (lab.round_trips).

It reports the RSS growth of the server and of the devices from the first window (a minute; a
quarter of a shorter run) to the last, errors, round-trip p50/p99 per window, and each fault
step with the tokens lost and duplicated in the requests open across it. It writes the soak's
JSON and a PNG (RSS over time, p99 per window) at --out, and the lab run's own folder beside
them (results.json, report.html, every process's log). Exit codes as `sled lab run`: 0 ok,
1 a greedy output differed, 2 bad flags, 3 a process did not start, a fault step did not
complete or a request failed.
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import time
from pathlib import Path

import aiomqtt
from rich.table import Table

from lab.bench import harness
from lab.bench.report import pyplot
from lab.fleet import FleetStartError
from lab.profiles import device_profile, link_profile
from lab.report import summary
from lab.results import Results, phase_totals
from lab.round_trips import RoundTrips
from lab.rss import RssSeries
from lab import run as lab_run
from lab.run import scenario_prompts
from lab.scenario import parse_scenario
from lab.tiny import cached_pair
from sled.flags import non_negative_float, positive_float, positive_int
from sled.models import resolve_model

SAMPLE_S = 5.0                  # between RSS samples and histogram scrapes
WINDOW_S = 60.0                 # growth and latency windows (a quarter of a shorter run)
LINK_CUT_S = 10.0


def add_arguments(parser) -> None:
    parser.add_argument("--devices", type=positive_int, default=64, help="device daemons")
    parser.add_argument("--minutes", type=positive_float, default=30.0, help="how long requests "
                        "are sent")
    parser.add_argument("--faults", action=argparse.BooleanOptionalAction, default=True,
                        help="kill the server, restart the broker and cut a link early in the run")
    parser.add_argument("--rate", type=non_negative_float, default=0.0, help="requests per second "
                        "per device, Poisson arrivals (0: each device asks again when answered)")
    harness.add_target_flags(parser, model_help="target alias or path (default: the tiny random "
                             "target)", dtype_help=None)
    parser.add_argument("--device-profile", default="pi5", help="the devices' board (lab.profiles)")
    parser.add_argument("--link", default="wifi", help="the devices' link (lab.profiles)")
    parser.add_argument("--max-tokens", type=positive_int, default=32, help="tokens per request")
    harness.add_out_flag(parser, "soak")


def run(args) -> int:
    logging.getLogger("mqtt").setLevel(logging.ERROR)   # paho's "N pending publish calls" per burst
    return harness.run_bench("soak", bench, args)


async def bench(args) -> int:
    """The scenario from the flags, the soak, its summary, table, JSON and plot."""
    console = harness.bench_console()
    with harness.flag_errors():
        scenario = soak_scenario(args)
        prompts = scenario_prompts(scenario)
    duration_s = scenario.duration_s
    watch = Watch(min(SAMPLE_S, duration_s / 15))
    folder = Path(args.out).with_suffix("")
    code, document = await soak(scenario, prompts, folder, watch)
    results = summarise(document, watch, min(WINDOW_S, duration_s / 4), args)
    _table(console, results)
    harness.write_results(console, args.out, results, plot=lambda png: _plot(results, png))
    return code


# --- the scenario --------------------------------------------------------------------------------

def soak_scenario(args):
    """The lab scenario the flags describe; a bad profile or link is a ValueError naming its flag."""
    for flag, profile, spec in (("--device-profile", device_profile, args.device_profile),
                                ("--link", link_profile, args.link)):
        try:
            profile(spec)
        except ValueError as exc:
            raise ValueError(f"{flag}: {exc}") from None
    duration_s = args.minutes * 60
    arrivals = {"mode": "poisson", "rate_per_s": args.rate} if args.rate else {"mode": "closed"}
    return parse_scenario({
        "name": "soak", "target": resolve_model(args.model) if args.model else cached_pair()[0],
        "fleet": [{"count": args.devices, "device": args.device_profile, "link": args.link,
                   "drafter": "ngram"}],
        "workload": {"source": "chat"}, "arrivals": arrivals, "duration_s": duration_s,
        "max_tokens": args.max_tokens, "sampling": {"temperature": 0.0, "seed": 0},
        "faults": fault_steps(duration_s) if args.faults else []}, "the soak's scenario")


def fault_steps(duration_s: float) -> list[dict]:
    """One step of each kind in the first third of the run, so that the server started after
    the kill serves most of it (its RSS growth is measured over that span)."""
    return [{"kind": "server_kill", "at_s": round(0.1 * duration_s, 1), "down_s": 2.0},
            {"kind": "link_cut", "at_s": round(0.2 * duration_s, 1), "device": "dev-00",
             "down_s": LINK_CUT_S},
            {"kind": "broker_restart", "at_s": round(0.3 * duration_s, 1), "down_s": 2.0}]


# --- the run -----------------------------------------------------------------------------------------

class Watch:
    """What the soak samples beside the lab's phase, every interval_s: the RSS of the server and
    the devices, and the devices' round-trip histograms."""

    def __init__(self, interval_s: float) -> None:
        self.interval_s = interval_s
        self.rss = RssSeries()
        self.trips = None

    @contextlib.asynccontextmanager
    async def beside(self, devices):
        """Samples now, every interval_s while the body runs, and once more at its end."""
        self.trips, started = RoundTrips(devices), time.monotonic()

        async def sample() -> None:
            at_s = time.monotonic() - started
            await asyncio.gather(asyncio.to_thread(self.rss.sample, at_s), self.trips.scrape(at_s))

        async def every_interval() -> None:
            while True:
                await asyncio.sleep(self.interval_s)
                await sample()

        await sample()
        task = asyncio.create_task(every_interval())
        try:
            yield self
        finally:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            await sample()


async def soak(scenario, prompts: list[str], folder: Path, watch: Watch) -> tuple[int, dict]:
    """One sled phase of the scenario on a local fleet, as `sled lab run` runs it (lab.run),
    with WATCH sampling beside it: the run's exit code and its results document."""
    references = await lab_run.greedy_references(scenario, prompts)
    fleet = lab_run.make_fleet("local", scenario, folder)
    results = Results(folder.name, fleet.mode, scenario)
    try:
        lab_run.write_calibrated_traces(scenario, references, fleet.traces_dir)
        lab_run.phase_line(f"starting the fleet: {len(scenario.slots())} devices, target {scenario.target}")
        await fleet.start(scenario.slots())
        results.link_emulation = fleet.link_emulation()
        async with watch.beside(fleet.devices):
            await lab_run.run_phase(fleet, scenario, "sled", len(fleet.devices), prompts,
                                    lab_run.outputs(references), results, scenario.faults)
    except (FleetStartError, TimeoutError, asyncio.TimeoutError, aiomqtt.MqttError) as exc:
        raise harness.Stop(f"{exc} (logs in {folder / 'logs'})", harness.SERVER_FAILED) from None
    finally:
        await fleet.stop()
    results.write(folder)
    return lab_run.finish(results, folder), results.document()


# --- what it found -----------------------------------------------------------------------------------

def summarise(document: dict, watch: Watch, window_s: float, args) -> dict:
    """The soak's results: the run's totals, the fault steps, RSS growth and latency per window."""
    phase = document["phases"][0]
    detail = summary.lossless_detail(document)
    return {"devices": args.devices, "minutes": args.minutes, "faults": args.faults,
            "rate_per_device": args.rate, "device_profile": args.device_profile, "link": args.link,
            "target": args.model or "tiny random llama", "machine": document["machine"],
            "run_folder": document["run"], "wall_s": phase["wall_s"], **phase_totals(phase),
            "lossless": summary.lossless(detail), "mismatched": detail["mismatched"],
            "fault_steps": [_fault(step) for step in summary.faults(document)],
            "window_s": round(window_s, 1),
            "rss": {"server": watch.rss.server_growth(window_s, _serving_again_s(document)),
                    "devices": watch.rss.device_growth(window_s)},
            "round_trip": watch.trips.per_window(window_s) if watch.trips else [],
            "rss_samples": watch.rss.samples}


def _serving_again_s(document: dict) -> float:
    """When the last server restart of the fault steps was serving again (0 without one)."""
    return max((step["done_at_s"] or 0.0 for step in document["faults"]
                if step["kind"] == "server_kill"), default=0.0)


def _fault(step: dict) -> dict:
    keep = ("kind", "device", "at_s", "down_s", "done_at_s", "ok", "note", "requests_overlapping",
            "lost_tokens", "duplicated_tokens", "errors")
    return {key: step.get(key) for key in keep}


def _pct(value) -> str:
    return "unknown" if value is None else f"{value:+.2f}%"


def _table(console, results: dict) -> None:
    table = Table(title=f"soak: {results['devices']} devices ({results['device_profile']}, "
                        f"{results['link']}) for {results['minutes']:g} min against "
                        f"{results['target']}")
    for column in ("measurement", "figure", "detail"):
        table.add_column(column)
    table.add_row("requests", f"{results['requests']:,}", f"{results['tokens']:,} tokens in "
                  f"{results['wall_s']:.0f} s; lossless: {results['lossless']}")
    table.add_row("errors", str(results["errors"]), "requests failed or cut short (goal 0)")
    server, devices = results["rss"]["server"], results["rss"]["devices"]
    if server.get("growth_pct") is not None:
        table.add_row("server RSS growth", _pct(server["growth_pct"]),
                      f"{server['first_mib']:.0f} -> {server['last_mib']:.0f} MiB, "
                      f"{server['from_s']:.0f}-{server['to_s']:.0f} s ({server['processes']} "
                      "processes: restarts count from their own start; goal < 5%)")
    if devices.get("devices"):
        table.add_row("device RSS growth", f"{_pct(devices['growth_pct_median'])} median",
                      f"max {_pct(devices['growth_pct_max'])}; {devices['first_mib_mean']:.0f} -> "
                      f"{devices['last_mib_mean']:.0f} MiB mean; all devices "
                      f"{_pct(devices['total']['growth_pct'])}")
    p99 = [w["p99_ms"] for w in results["round_trip"] if w["p99_ms"] is not None]
    if p99:
        table.add_row(f"round trip p99 per {results['window_s']:g} s", f"{min(p99):.0f}-{max(p99):.0f} ms",
                      f"{sum(w['rounds'] for w in results['round_trip']):,} rounds")
    for step in results["fault_steps"]:
        table.add_row(f"fault {step['kind']} at {step['at_s']:.0f} s",
                      f"{step['lost_tokens']} lost / {step['duplicated_tokens']} duplicated",
                      f"{'ok' if step['ok'] else 'FAILED'}: {step['note']}; "
                      f"{step['requests_overlapping']} requests open across it")
    console.print(table)


def _plot(results: dict, png: Path) -> None:
    """RSS of the server and the mean device over time (fault steps marked), and the round-trip
    p50/p99 per window."""
    plt = pyplot()
    samples = results["rss_samples"]
    fig, (memory, latency) = plt.subplots(2, 1, figsize=(8, 6), sharex=True)
    for n, pid in enumerate(dict.fromkeys(s["server_pid"] for s in samples if s["server_pid"])):
        server = [(s["at_s"] / 60, s["server_mib"]) for s in samples if s["server_pid"] == pid]
        memory.plot(*zip(*server), label=None if n else "server", color="tab:blue")  # one line a process
    devices = [(s["at_s"] / 60, sum(s["devices_mib"].values()) / len(s["devices_mib"]))
               for s in samples if s["devices_mib"]]
    if devices:
        memory.plot(*zip(*devices), label="device (mean)", color="tab:green")
    for step in results["fault_steps"]:
        for axis in (memory, latency):
            axis.axvline(step["at_s"] / 60, color="tab:red", linestyle=":", linewidth=1)
        memory.annotate(step["kind"], (step["at_s"] / 60, 0), xycoords=("data", "axes fraction"),
                        rotation=90, fontsize=7, va="bottom", ha="right", color="tab:red")
    memory.set(ylabel="RSS (MiB)", title=f"soak: {results['devices']} devices, "
                                         f"{results['minutes']:g} min")
    memory.legend(loc="center right")
    windows = results["round_trip"]
    middle = [(w["from_s"] + w["to_s"]) / 120 for w in windows]
    for key, label in (("p99_ms", "p99"), ("p50_ms", "p50")):
        latency.plot(middle, [w[key] for w in windows], marker="o", label=f"round trip {label}")
    latency.set(xlabel="minutes into the run", ylabel="ms",
                title=f"round trip per {results['window_s']:g} s window")
    latency.legend()
    fig.tight_layout()
    fig.savefig(png, dpi=120)
    plt.close(fig)
