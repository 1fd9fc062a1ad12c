"""`sled lab compose SCENARIO`: run a scenario in Docker Compose and collect its report.

Steps, each shown as it runs; a step that fails ends the command with one line (the step and the
tail of its log) and exit status 3:
  base image   sled-base:bookworm-HASH from debootstrap (--build-base; HASH: its packages), or
               --base-image
  wheelhouse   every dependency of the images (cached by pyproject.toml, llama.cpp flags, torch)
  project      the project's wheel, built from this tree
  images       each image's dependencies image (cached by wheelhouse + base), then the server and
               device images (that plus the project's wheel: seconds) and the broker image
  arm64 image  a scenario with `arch: arm64` devices on an amd64 host: the arm64 base, wheelhouse
               and device image (lab.images_arm64), run as linux/arm64 containers by qemu-user
               through binfmt_misc (a machine without it: one line, exit status 2)
  run folder   broker files (lab.broker), the scenario (a prompt file copied beside it), the
               compose environment and override
  up           broker, server and one device replica per slot (--scale device=N, and
               device-arm64=M, profile arm64, for arm64 slots); with server.replicas 2 (profile
               replicas) also server-1 and the HAProxy the devices dial
  limits       each device container's CPU quota and memory limit from its device profile
  passwords    each device container gets its own broker password, and only its own: devices
               mount state/ and scenario.yaml, never broker/ (credentials.json holds them all)
  lab          `sled lab run /lab/scenario.yaml --fleet compose` in the lab container
  logs         the broker's, server's and devices' logs into OUT/<run>/logs/compose.log
  down         containers, networks and volumes of the run (images stay as a cache)
The report lands in OUT/<run>/ like `sled lab run`'s. The exit status is the lab's (0 ok, 1 a
greedy output differed from the target's, 2 bad scenario, 3 a component did not start).
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path

import yaml
from rich.console import Console

from lab.arch import ARCHES, ArchUnavailable, emulation_ready, machine_arch, service, slot_arch
from lab.broker import BrokerFiles, Listener, replica_login
from sled.pki import write_secret
from lab.device_entry import GGUF_FILES, PASSWORD_FILE, wait_slot_files
from lab.images import (DOCKER, ROOT, TORCH, BuildError, base_image, build_images, project_wheel,
                        remove_images, run_step, wheelhouse)
from lab.images_arm64 import arm64_images
from lab.profiles import device_profile
from lab.proxy import haproxy_config
from lab.scenario import TINY_TARGET, ScenarioError, load_scenario, scenario_path
from lab.workload import is_prompt_file
from sled.cache import cache_dir
from sled.models import BUILTIN, converted_checkpoint

COMPOSE_FILE = ROOT / "docker-compose.yml"
GPU_FILE = ROOT / "docker-compose.gpu.yml"
OVERRIDE = "lab.override.yml"
SLOT_WAIT_S = 180.0
# The replicas profile: the servers' services in replica order, and the proxy devices dial.
REPLICA_SERVICES = ("server", "server-1")
PROXY_ENDPOINT = "proxy:50051"
DOCKER_DNS = "127.0.0.11:53"        # the engine's resolver inside a compose network


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("scenario", help="a built-in scenario (smoke, fleet16, ...) or a YAML file")
    parser.add_argument("--out", default="lab-results", metavar="DIR",
                        help="where the run's folder goes (default: lab-results)")
    parser.add_argument("--run", default=None, metavar="NAME",
                        help="the run's folder name under --out (default: scenario and time)")
    parser.add_argument("--base-image", default=None, metavar="IMAGE",
                        help="the images' base (default: sled-base:bookworm-HASH when built, else "
                             "python:3.11-slim-bookworm)")
    parser.add_argument("--build-base", action="store_true",
                        help="build sled-base:bookworm-HASH (HASH: its Debian packages) with "
                             "debootstrap when it is missing")
    parser.add_argument("--gpu", action="store_true",
                        help="the server on one NVIDIA GPU (docker-compose.gpu.yml)")
    parser.add_argument("--observe", action="store_true",
                        help="also start Prometheus and Grafana (compose profile observe)")
    parser.add_argument("--keep", action="store_true",
                        help="leave the fleet running and the run folder in place")
    parser.add_argument("--clean-images", action="store_true",
                        help="remove the lab's images afterwards (their dependencies images too)")
    parser.add_argument("--torch", default=TORCH, metavar="SPEC",
                        help=f"the torch the server image installs (default: {TORCH}); with "
                             "--gpu a CUDA build of it")


def run(args: argparse.Namespace) -> int:
    missing = [p.name for p in (COMPOSE_FILE, DOCKER) if not p.exists()]
    if missing:
        print(f"sled lab compose: {' and '.join(missing)} not found next to the lab package "
              f"({ROOT}); run it from a checkout of the sled repository", file=sys.stderr)
        return 2
    try:
        scenario = load_scenario(args.scenario)
        emulation_ready(scenario.slots())
    except (ScenarioError, ArchUnavailable) as exc:
        print(f"sled lab compose: {exc}", file=sys.stderr)
        return 2
    run_name = args.run or f"{scenario.name}-{datetime.now(timezone.utc):%Y%m%d-%H%M%S}"
    lab = ComposeLab(scenario, scenario_path(args.scenario), run_name, Path(args.out).resolve(),
                     gpu=args.gpu, observe=args.observe)
    try:
        return lab.run_all(args)
    except BuildError as exc:
        print(f"sled lab compose: {exc}", file=sys.stderr)
        return 3


def compose_command() -> list[str]:
    """`docker compose` (v2) when the plugin answers, else Debian's `docker-compose`."""
    try:
        if subprocess.run(["docker", "compose", "version"], capture_output=True).returncode == 0:
            return ["docker", "compose"]
    except FileNotFoundError:
        pass
    if shutil.which("docker-compose"):
        return ["docker-compose"]
    raise BuildError("docker compose", "neither `docker compose` nor `docker-compose` is installed "
                     "(Debian: apt-get install docker.io docker-compose)")


def docker_ready() -> None:
    """The engine answers, or one line saying what to do."""
    try:
        done = subprocess.run(["docker", "info"], capture_output=True, text=True)
    except FileNotFoundError:
        raise BuildError("docker", "docker is not installed (Debian: apt-get install docker.io "
                         "docker-compose; or make docker)") from None
    if done.returncode != 0:
        raise BuildError("docker", f"the Docker engine does not answer: {done.stderr.strip()}")


def replicas_ready(scenario, gpu: bool = False) -> None:
    """Compose runs one server, or two replicas behind the proxy (the services of its replicas
    profile) on the CPU: docker-compose.gpu.yml gives the one server its GPU."""
    if gpu and scenario.server.replicas > 1:
        raise BuildError("replicas", "--gpu gives one GPU to the one server "
                         "(docker-compose.gpu.yml); run server.replicas 2 without --gpu")
    if scenario.server.replicas > len(REPLICA_SERVICES):
        raise BuildError("replicas", f"server.replicas {scenario.server.replicas}: the compose lab "
                         f"runs at most {len(REPLICA_SERVICES)} (docker-compose.yml's replicas "
                         "profile); `sled lab run` runs more on this machine")


def models_ready(scenario) -> None:
    """The built-in models the containers read from the host's cache are there (the containers
    have no models extra to assemble or convert them)."""
    missing = []
    if scenario.target in BUILTIN and converted_checkpoint(scenario.target) is None:
        missing.append(f"the target {scenario.target}")
    for drafter in sorted({slot.drafter for slot in scenario.slots()}):
        kind, _, alias = drafter.partition(":")
        if alias not in BUILTIN:
            continue
        path = cache_dir() / (GGUF_FILES.get(alias, f"gguf/{alias}.gguf") if kind == "gguf"
                              else f"onnx/{alias}-int4")
        if kind in ("gguf", "onnx") and not path.exists():
            missing.append(f"the drafter {drafter}")
    if missing:
        raise BuildError("models", f"{', '.join(missing)} not in {cache_dir()}: run "
                         "`sled models prepare --onnx` first")


def target_ready(scenario) -> None:
    """The server container sees only the sled cache: a target given as a path is refused."""
    target = scenario.target
    if target == TINY_TARGET:
        raise BuildError("models", "target: tiny (the tiny random target an emulated server "
                         "computes with) runs with `sled lab run` on this machine's processes, "
                         "not in containers; give a built-in target (sled models list) here")
    if target not in BUILTIN and (target.startswith(("/", ".", "~"))
                                  or Path(target).expanduser().exists()):
        raise BuildError("models", f"the target {target!r} is a path, which the server container "
                         "does not mount; use a built-in target (sled models list)")


@dataclass
class ComposeLab:
    """One compose run of a scenario: its run folder, project name and compose command line."""
    scenario: object
    scenario_file: Path
    run_name: str
    out: Path
    gpu: bool = False
    observe: bool = False
    tags: dict = field(default_factory=dict)

    @property
    def project(self) -> str:
        return "sledlab" + "".join(c for c in self.run_name.lower() if c.isalnum())[-24:]

    @property
    def run_dir(self) -> Path:
        return self.out / f".compose-{self.run_name}"

    def compose(self, *words: str) -> list[str]:
        files = [COMPOSE_FILE] + ([GPU_FILE] if self.gpu else []) + [self.run_dir / OVERRIDE]
        argv = compose_command() + ["-p", self.project, "--project-directory", str(ROOT),
                                    "--env-file", str(self.run_dir / ".env")]
        for file in files:
            argv += ["-f", str(file)]
        profiles = (["lab"] + (["replicas"] if self.replicas > 1 else [])
                    + [name.removeprefix("device-") for name in self.device_services
                       if name != "device"] + (["observe"] if self.observe else []))
        for profile in profiles:
            argv += ["--profile", profile]
        return argv + list(words)

    @property
    def replicas(self) -> int:
        return self.scenario.server.replicas

    @property
    def device_services(self) -> dict[str, int]:
        """Each device service of this run and its replicas: `device` for the host's
        architecture, `device-arm64` (profile arm64) for arm64 slots on an amd64 host."""
        host, counts = machine_arch(), {}
        for slot in self.scenario.slots():
            name = service(slot_arch(slot, host), host)
            counts[name] = counts.get(name, 0) + 1
        return counts

    @property
    def servers(self) -> list[str]:
        """The server services of this run: `server`, and `server-1` behind the proxy."""
        return list(REPLICA_SERVICES[:self.replicas])

    def run_all(self, args: argparse.Namespace) -> int:
        progress = Steps()
        progress.step("replicas", replicas_ready, self.scenario, self.gpu)
        progress.step("docker", docker_ready)
        progress.step("models", target_ready, self.scenario)
        progress.step("models", models_ready, self.scenario)
        base = args.base_image or progress.step("base image", base_image, args.build_base)
        house = progress.step("wheelhouse", wheelhouse, None, args.torch)
        wheel = progress.step("project", project_wheel)
        self.tags = progress.step("images", build_images, base, house, wheel)
        if "device-arm64" in self.device_services:
            self.tags |= progress.step("arm64 image", arm64_images, wheel)
        if self.gpu:
            progress.step("cuda torch", cuda_torch_ready, self.tags["server"])
        progress.step("run folder", self.write_run_folder)
        try:
            progress.step("up", self.up)
            progress.step("limits", self.apply_limits)
            progress.step("passwords", self.deliver_passwords)
            status = progress.step("lab", self.run_lab)
        finally:
            if not args.keep:
                progress.step("logs", self.save_logs)
                progress.step("down", self.down)
                if args.clean_images:
                    remove_images(list(self.tags.values()))
        report = self.out / self.run_name
        print(f"sled lab compose: report in {report}" if (report / "report.json").is_file()
              else f"sled lab compose: the lab wrote no report (exit {status})")
        return status

    def write_run_folder(self) -> None:
        write_run_folder(self)

    def up(self) -> None:
        devices = self.device_services
        scales = [word for name, n in devices.items() for word in ("--scale", f"{name}={n}")]
        services = (["broker", *self.servers] + (["proxy"] if self.replicas > 1 else [])
                    + list(devices) + (["prometheus", "grafana"] if self.observe else []))
        run_step("up", self.compose("up", "-d", "--no-build", *scales, *services))

    def apply_limits(self) -> None:
        apply_limits(self.run_dir / "state" / "slots", len(self.scenario.slots()))

    def deliver_passwords(self) -> None:
        credentials = json.loads((self.run_dir / "broker" / "credentials.json").read_text())
        deliver_passwords(self.run_dir / "state" / "slots", len(self.scenario.slots()),
                          credentials)

    def run_lab(self) -> int:
        """The lab container, its output straight to this terminal; its exit status."""
        argv = self.compose("run", "--rm", "--no-deps", "-T", "lab")
        return subprocess.run(argv).returncode

    def save_logs(self) -> None:
        """The broker's, server's and devices' logs into OUT/<run>/logs/compose.log."""
        folder = self.out / self.run_name / "logs"
        folder.mkdir(parents=True, exist_ok=True)
        with (folder / "compose.log").open("w") as sink:
            proxy = ["proxy"] if self.replicas > 1 else []
            subprocess.run(self.compose("logs", "--no-color", "broker", *self.servers, *proxy,
                                        *self.device_services),
                           stdout=sink, stderr=subprocess.STDOUT)

    def down(self) -> None:
        subprocess.run(self.compose("down", "--volumes", "--remove-orphans", "--timeout", "5"),
                       capture_output=True)
        shutil.rmtree(self.run_dir, ignore_errors=True)


class Steps:
    """Each step on its own line with its time (rich), or BuildError with the step's name."""

    def __init__(self) -> None:
        self.console = Console(stderr=True)

    def step(self, name: str, fn, *args):
        started = time.monotonic()
        self.console.print(f"[bold]{name}[/bold] ...")
        try:
            result = fn(*args)
        except BuildError:
            raise
        except (OSError, subprocess.SubprocessError, ValueError) as exc:
            raise BuildError(name, str(exc)) from None
        self.console.print(f"[green]{name}[/green] done in {time.monotonic() - started:.1f} s")
        return result


def write_run_folder(lab: ComposeLab) -> None:
    """Broker files, the scenario, .env and the override for this fleet."""
    run_dir = lab.run_dir
    shutil.rmtree(run_dir, ignore_errors=True)
    (run_dir / "state" / "slots").mkdir(parents=True)
    lab.out.mkdir(parents=True, exist_ok=True)
    slots = lab.scenario.slots()
    # The broker container stays root (`user root`): the password file is 0600 and the host's,
    # and a uid inside the image cannot be known from here.
    files = BrokerFiles.write(run_dir / "broker", slots,
                              listener=Listener(root="/mosquitto/config", port=1883, run_as="root"),
                              replicas=lab.replicas)
    write_scenario(lab, run_dir)
    (run_dir / "proxy").mkdir()
    if lab.replicas > 1:
        (run_dir / "proxy" / "haproxy.cfg").write_text(haproxy_config(
            "0.0.0.0:50051", [f"{service}:50051" for service in lab.servers],
            nameserver=DOCKER_DNS))
    env = compose_env(lab, files.password("server"))
    if lab.replicas > 1:
        env["SLED_SERVER_1_MQTT_PASSWORD"] = files.password(replica_login(1)[0])
    write_secret(run_dir / ".env", "".join(f"{k}={v}\n" for k, v in env.items()))
    (run_dir / OVERRIDE).write_text(override_text(lab))


def write_scenario(lab: ComposeLab, run_dir: Path) -> None:
    """scenario.yaml for the containers, each fleet group's arch given (the host's where the
    scenario gives none); a prompt-file workload is copied to workload/ beside it and the copy's
    workload.source names it as the containers see it (/lab/workload/...)."""
    data = yaml.safe_load(lab.scenario_file.read_text())
    (run_dir / "workload").mkdir()
    source = lab.scenario.workload.source
    if is_prompt_file(source):
        prompts = Path(source).expanduser()
        if not prompts.is_absolute():       # relative to the scenario file's folder
            prompts = lab.scenario_file.resolve().parent / prompts
        if not prompts.is_file():
            raise ValueError(f"the workload's prompt file {source!r} is not a file "
                             f"(looked at {prompts})")
        shutil.copyfile(prompts, run_dir / "workload" / prompts.name)
        data["workload"]["source"] = f"/lab/workload/{prompts.name}"
    if machine_arch() in ARCHES:    # each replica takes the slots of its own architecture
        for group in data["fleet"]:
            group["arch"] = group.get("arch") or machine_arch()
    (run_dir / "scenario.yaml").write_text(yaml.safe_dump(data, sort_keys=False))


def compose_env(lab: ComposeLab, server_password: str) -> dict[str, str]:
    return {
        "COMPOSE_PROJECT_NAME": lab.project,
        "SLED_SERVER_IMAGE": lab.tags.get("server", "sled-lab-server:latest"),
        "SLED_DEVICE_IMAGE": lab.tags.get("device", "sled-lab-device:latest"),
        "SLED_DEVICE_ARM64_IMAGE": lab.tags.get("device-arm64", "sled-lab-device-arm64:latest"),
        "SLED_BROKER_IMAGE": lab.tags.get("broker", "sled-lab-broker:latest"),
        "SLED_PROXY_IMAGE": lab.tags.get("proxy", "sled-lab-proxy:latest"),
        "SLED_TARGET": lab.scenario.target,
        "SLED_RUN_DIR": str(lab.run_dir),
        "SLED_RESULTS": str(lab.out),
        "SLED_CACHE": str(cache_dir().resolve()),
        "SLED_RUN": lab.run_name,
        "SLED_SERVER_MQTT_PASSWORD": server_password,
    }


def override_text(lab: ComposeLab) -> str:
    """The scenario's part of the compose model: each server's extra flags (as a list, so no
    shell splits them) and labels naming the run. JSON is YAML, and needs no quoting rules."""
    labels = {"sled.lab.run": lab.run_name, "sled.lab.scenario": lab.scenario.name}
    services = {name: {"labels": labels} for name in ("broker", *lab.device_services, "lab",
                                                      *lab.servers)}
    if lab.replicas > 1:
        services["proxy"] = {"labels": labels}
    for index, service in enumerate(lab.servers):
        services[service]["command"] = server_command(lab, index)
    return json.dumps({"services": services}, indent=2) + "\n"


def server_command(lab: ComposeLab, index: int) -> list[str]:
    """Replica INDEX's `sled serve` (the one server's when there is one): it announces the
    proxy's address when the devices dial a proxy, its own otherwise."""
    user, server_id = replica_login(index)
    endpoint = PROXY_ENDPOINT if lab.replicas > 1 else "server:50051"
    return (["serve", "--model", lab.scenario.target] + (["--device", "cuda"] if lab.gpu else [])
            + ["--host", "0.0.0.0", "--port", "50051", "--metrics-port", "9400",
               "--mqtt-host", "broker", "--mqtt-username", user, "--server-id", server_id,
               "--announce-endpoint", endpoint] + list(lab.scenario.server.flags))


def read_slot_files(folder: Path, count: int, timeout_s: float = SLOT_WAIT_S) -> list[dict]:
    """The N slot files the device replicas write, waiting for all of them."""
    try:
        return wait_slot_files(folder, count, timeout_s)
    except TimeoutError as exc:
        raise BuildError("slots", f"{exc} (see the device containers' logs)") from None


def deliver_passwords(folder: Path, count: int, credentials: dict[str, str]) -> None:
    """Each device container's own broker password into a file inside it (written whole, then
    renamed, so its entrypoint never reads half of it); no container sees another's."""
    for slot in read_slot_files(folder, count):
        script = (f"umask 077 && cat > {PASSWORD_FILE}.partial "
                  f"&& mv {PASSWORD_FILE}.partial {PASSWORD_FILE}")
        run_step(f"password ({slot['id']})",
                 ["docker", "exec", "-i", slot["container"], "sh", "-c", script],
                 input=credentials[slot["id"]])


def cuda_torch_ready(server_image: str) -> None:
    """With --gpu the server image's torch must be a CUDA build."""
    probe = "import torch; print(torch.version.cuda)"
    out = run_step("cuda torch", ["docker", "run", "--rm", "--entrypoint", "/opt/sled/bin/python",
                                  server_image, "-c", probe]).strip().splitlines()
    if not out or out[-1] in ("", "None"):
        raise BuildError("cuda torch", "the server image's torch is a CPU build; pass --torch "
                         "with a CUDA build of torch (e.g. --torch 'torch==2.13.0+cu128' with "
                         "that wheel reachable by pip) for --gpu")


def apply_limits(folder: Path, count: int) -> None:
    """`docker update` each device container to its device profile's CPU quota and memory."""
    host_cpus = os.cpu_count() or 1
    for slot in read_slot_files(folder, count):
        profile = device_profile(slot["device"])
        argv = ["docker", "update"]
        if profile.cpus:
            argv += ["--cpus", f"{profile.cpus_on(host_cpus):g}"]
        if profile.memory_mb:
            argv += ["--memory", f"{profile.memory_mb}m", "--memory-swap", f"{profile.memory_mb}m"]
        if len(argv) > 2:
            run_step(f"limits ({slot['id']})", argv + [slot["container"]])
