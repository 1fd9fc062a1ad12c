"""A lab scenario: the fleet, the workload, the SLO and the fault timeline, read from YAML.

`load_scenario("smoke")` reads the built-in lab/scenarios/smoke.yaml; any other spec is a path.
A bad scenario raises ScenarioError naming the key and the file.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from lab.arch import check_arch
from lab.costs import assumptions
from lab.profiles import device_profile, link_profile
from lab.traces.calibrated import is_calibrated, load_calibration
from lab.workload import is_prompt_file
from verify_server.step_costs import shipped_profiles

SCENARIOS = Path(__file__).with_name("scenarios")


# `target: tiny` serves the tiny random target in sled's cache (lab.tiny): a target whose text
# means nothing, cheap enough for an emulated GPU server (server.emulate) on a small machine.
TINY_TARGET = "tiny"


class ScenarioError(ValueError):
    """A scenario that cannot run: the message names the key and the file."""


@dataclass(frozen=True)
class DeviceSlot:
    """One device of the expanded fleet, in order: ids dev-00, dev-01, ..."""
    index: int
    id: str
    device: str     # device profile spec, e.g. "pi5"
    link: str       # link profile spec, e.g. "wifi:rtt_ms=20"
    drafter: str    # drafter spec, e.g. "gguf:gemma3-270m"
    group: int      # which fleet entry it came from
    arch: str | None = None     # "amd64" or "arm64" (lab.arch); None: the lab machine's own


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class FleetGroup(_Strict):
    count: int = Field(1, ge=1)
    device: str
    link: str
    drafter: str
    # the device containers' architecture, amd64 or arm64 (compose: platform linux/ARCH, run
    # under qemu-user when it is not the host's); none: the host's own
    arch: str | None = None

    @field_validator("arch")
    @classmethod
    def _arch(cls, value: str | None) -> str | None:
        return check_arch(value)

    @field_validator("device")
    @classmethod
    def _device(cls, spec: str) -> str:
        device_profile(spec)
        return spec

    @field_validator("link")
    @classmethod
    def _link(cls, spec: str) -> str:
        link_profile(spec)
        return spec

    @field_validator("drafter")
    @classmethod
    def _calibrated(cls, spec: str) -> str:
        """calibrated:NAME names a shipped pair (other specs are checked by the daemon)."""
        if is_calibrated(spec):
            load_calibration(spec)
        return spec


class Workload(_Strict):
    source: str = "humaneval"       # "humaneval", "chat" or a prompt file
    limit: int | None = Field(None, ge=1)


class Arrivals(_Strict):
    mode: Literal["closed", "poisson"] = "closed"
    rate_per_s: float | None = Field(None, gt=0)     # per device, poisson only

    @model_validator(mode="after")
    def _rate(self) -> "Arrivals":
        if self.mode == "poisson" and self.rate_per_s is None:
            raise ValueError("poisson arrivals need rate_per_s")
        return self


class Sampling(_Strict):
    temperature: float = Field(0.0, ge=0)
    top_p: float = Field(1.0, gt=0, le=1)
    top_k: int = Field(0, ge=0)
    seed: int | None = None

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


class Slo(_Strict):
    tokens_per_s: float = Field(10.0, gt=0)    # per device
    ttft_s: float = Field(2.0, gt=0)


class Fault(_Strict):
    at_s: float = Field(ge=0)
    kind: Literal["server_kill", "broker_restart", "link_cut"]
    device: str | None = None       # link_cut: the device id
    replica: int | None = None      # server_kill behind the proxy: which replica (0, 1, ...)
    down_s: float = Field(2.0, ge=0)


class ServerSection(_Strict):
    args: list[str] = []
    # how many `sled serve` replicas, behind one HAProxy when more than one (lab.proxy): the
    # devices dial the proxy, and each replica's load is in the report
    replicas: int = Field(1, ge=1, le=8)
    # a step-cost profile (verify_server.step_costs) the server holds its steps to: the fleet
    # as the profiled GPU would serve it (`sled serve --emulate`)
    emulate: str | None = None

    @field_validator("emulate")
    @classmethod
    def _known_profile(cls, value: str | None) -> str | None:
        """A shipped profile by name: the server may run in a container, which sees no file
        of the host's (a profile file goes to `sled serve --emulate FILE` or `sled bench
        serve --emulate FILE`)."""
        if value and value not in shipped_profiles():
            raise ValueError(f"unknown step profile {value!r}: server.emulate names a shipped "
                             f"profile ({', '.join(shipped_profiles())}), not a file, which a "
                             "containerized server could not read")
        return value or None

    @property
    def flags(self) -> list[str]:
        """The `sled serve` flags of this section."""
        return [*self.args, *(["--emulate", self.emulate] if self.emulate else [])]


class Scenario(_Strict):
    name: str
    target: str
    fleet: list[FleetGroup] = Field(min_length=1)
    workload: Workload = Workload()
    arrivals: Arrivals = Arrivals()
    requests: int | None = Field(None, ge=1)
    duration_s: float | None = Field(None, gt=0)
    max_tokens: int = Field(64, ge=1)
    sampling: Sampling = Sampling()
    slo: Slo = Slo()
    centralized: bool = False
    fleet_sizes: list[int] | None = None
    # the fleet's slots taken one group after another (false) or in turn from each group (true),
    # so that every fleet size of fleet_sizes holds every kind of device
    interleave: bool = False
    faults: list[Fault] = []
    via: Literal["mqtt", "openai"] = "mqtt"
    costs: dict[str, Any] = {}
    server: ServerSection = ServerSection()

    @field_validator("costs")
    @classmethod
    def _known_costs(cls, value: dict) -> dict:
        assumptions(value)          # an unknown key or a bad value stops here, not after the run
        return value

    @model_validator(mode="after")
    def _consistent(self) -> "Scenario":
        if (self.requests is None) == (self.duration_s is None):
            raise ValueError("give exactly one of requests and duration_s")
        total = sum(group.count for group in self.fleet)
        for n in self.fleet_sizes or []:
            if not 1 <= n <= total:
                raise ValueError(f"fleet_sizes: {n} is not within 1..{total} (the fleet's size)")
        if not self.sampling.greedy and any(is_calibrated(g.drafter) for g in self.fleet):
            raise ValueError("fleet: calibrated: drafters replay the target's greedy output; "
                             "set sampling.temperature to 0")
        ids = {slot.id for slot in self.slots()}
        for i, fault in enumerate(self.faults):
            if fault.kind == "link_cut" and fault.device not in ids:
                raise ValueError(f"faults.{i}.device: link_cut needs a device id of the fleet "
                                 f"(dev-00..dev-{total - 1:02d}), not {fault.device!r}")
            self._check_replica(i, fault)
        return self

    def _check_replica(self, i: int, fault: Fault) -> None:
        """A server_kill behind the proxy names the replica it kills; no other step names one."""
        replicas = self.server.replicas
        if fault.kind != "server_kill":
            if fault.replica is not None:
                raise ValueError(f"faults.{i}.replica: only a server_kill names a replica")
        elif replicas > 1 and fault.replica is None:
            raise ValueError(f"faults.{i}.replica: with server.replicas {replicas}, a "
                             f"server_kill names the replica it kills (0..{replicas - 1})")
        elif fault.replica is not None and not 0 <= fault.replica < replicas:
            raise ValueError(f"faults.{i}.replica: {fault.replica} is not a replica of "
                             f"server.replicas {replicas} (0..{replicas - 1})")

    def slots(self) -> list[DeviceSlot]:
        """The fleet expanded in order: groups [a x2, b x1] give a, a, b, or a, b, a when
        interleaved."""
        slots: list[DeviceSlot] = []
        for group_index in self._slot_groups():
            group, i = self.fleet[group_index], len(slots)
            slots.append(DeviceSlot(i, f"dev-{i:02d}", group.device, group.link,
                                    group.drafter, group_index, group.arch))
        return slots

    def _slot_groups(self) -> list[int]:
        """The group of each slot, in slot order."""
        if not self.interleave:
            return [g for g, group in enumerate(self.fleet) for _ in range(group.count)]
        rounds = max(group.count for group in self.fleet)
        return [g for r in range(rounds) for g, group in enumerate(self.fleet) if r < group.count]

    def served_target(self) -> str:
        """What `sled serve --model` loads: the target; `tiny` is the tiny random target in
        sled's cache (written on first use), for emulated servers whose text means nothing."""
        if self.target != TINY_TARGET:
            return self.target
        # not at the top: lab.tiny imports torch, and a device container (lab.device_entry) reads
        # scenarios
        from lab.tiny import cached_pair

        return cached_pair()[0]

    def sizes(self) -> list[int]:
        """The fleet sizes to run: the first n devices for each n."""
        return list(self.fleet_sizes or [len(self.slots())])


def scenario_path(spec: str | Path) -> Path:
    """A built-in name ("smoke") or a path to a YAML file."""
    path = Path(spec)
    if path.suffix in (".yaml", ".yml") or path.exists():
        return path
    return SCENARIOS / f"{spec}.yaml"


def builtin_scenarios() -> list[str]:
    return sorted(p.stem for p in SCENARIOS.glob("*.yaml"))


def load_scenario(spec: str | Path) -> Scenario:
    path = scenario_path(spec)
    if not path.is_file():
        raise ScenarioError(f"scenario {str(spec)!r} is neither a file nor a built-in "
                            f"({', '.join(builtin_scenarios())})")
    try:
        data = yaml.safe_load(path.read_text())
    except yaml.YAMLError as e:
        raise ScenarioError(f"{path}: not valid YAML: {str(e).splitlines()[0]}") from None
    if not isinstance(data, dict):
        raise ScenarioError(f"{path}: a scenario is a mapping of keys (name, target, fleet, ...)")
    scenario = parse_scenario(data, path)
    scenario.workload.source = _beside(scenario.workload.source, path)
    return scenario


def _beside(source: str, scenario_file: Path) -> str:
    """A relative prompt file is read from the scenario file's folder."""
    prompts = Path(source).expanduser()
    if not is_prompt_file(source) or prompts.is_absolute():
        return source
    return str(scenario_file.resolve().parent / prompts)


def parse_scenario(data: dict, path: Path | str = "<scenario>") -> Scenario:
    try:
        return Scenario.model_validate(data)
    except ValidationError as e:
        raise ScenarioError(f"{path}: {_first_error(e)}") from None


def _first_error(e: ValidationError) -> str:
    error = e.errors()[0]
    key = ".".join(str(part) for part in error["loc"]) or "(top level)"
    message = error["msg"].removeprefix("Value error, ")
    if error["type"] == "extra_forbidden":
        message = "unknown key"
    return f"{key}: {message}"
