"""Lab scenarios: what a bad scenario says (the key and the file), the fleet's expansion into
device slots, built-in names, and every shipped scenario loading."""
from __future__ import annotations

import pytest
import yaml

from lab.scenario import (DeviceSlot, ScenarioError, builtin_scenarios, load_scenario,
                          parse_scenario)

BASE = {"name": "t", "target": "gemma3-270m", "requests": 1,
        "fleet": [{"count": 2, "device": "pi5", "link": "wifi", "drafter": "ngram"},
                  {"count": 1, "device": "orin-nano", "link": "ethernet:rtt_ms=2",
                   "drafter": "gguf:gemma3-270m"}]}


def write(tmp_path, data) -> str:
    path = tmp_path / "scenario.yaml"
    path.write_text(yaml.safe_dump(data))
    return str(path)


def changed(**changes) -> dict:
    data = {**BASE, "fleet": [dict(group) for group in BASE["fleet"]]}
    data.update(changes)
    return data


def error_of(tmp_path, data) -> str:
    path = write(tmp_path, data)
    with pytest.raises(ScenarioError) as caught:
        load_scenario(path)
    assert path in str(caught.value)          # every message names the file
    return str(caught.value)


def test_slots_expand_the_fleet_in_order():
    slots = parse_scenario(BASE).slots()
    assert slots == [DeviceSlot(0, "dev-00", "pi5", "wifi", "ngram", 0),
                     DeviceSlot(1, "dev-01", "pi5", "wifi", "ngram", 0),
                     DeviceSlot(2, "dev-02", "orin-nano", "ethernet:rtt_ms=2", "gguf:gemma3-270m", 1)]
    assert parse_scenario(BASE).sizes() == [3]
    assert parse_scenario(changed(fleet_sizes=[1, 3])).sizes() == [1, 3]


def test_an_interleaved_fleet_takes_each_group_in_turn():
    slots = parse_scenario(changed(interleave=True)).slots()
    assert [(s.id, s.device, s.group) for s in slots] == [
        ("dev-00", "pi5", 0), ("dev-01", "orin-nano", 1), ("dev-02", "pi5", 0)]
    fleet = load_scenario("fleet-h100")
    first = fleet.slots()[:4]
    assert {(s.device, s.link) for s in first} == {("pi5", "wifi"), ("orin-nano", "lte"),
                                                   ("pi5", "lte"), ("orin-nano", "wifi")}
    assert fleet.sizes() == [1, 4, 16, 64, 128] and len(fleet.slots()) == 128
    assert fleet.server.emulate == "h100-llama8b-hf-graph" and fleet.target == "tiny"


@pytest.mark.parametrize("data, key", [
    (changed(fleet=[]), "fleet"),
    (changed(fleet=[{"count": 0, "device": "pi5", "link": "wifi", "drafter": "ngram"}]), "fleet.0.count"),
    (changed(fleet=[{"count": 1, "device": "pi9", "link": "wifi", "drafter": "ngram"}]), "fleet.0.device"),
    (changed(fleet=[{"count": 1, "device": "pi5", "link": "wifi:bogus=1", "drafter": "ngram"}]),
     "fleet.0.link"),
    (changed(fleet_sizes=[4]), "fleet_sizes"),
    (changed(fleet_sizes=[0]), "fleet_sizes"),
    (changed(faults=[{"kind": "link_cut", "at_s": 1, "device": "dev-07", "down_s": 1}]), "faults.0.device"),
    (changed(faults=[{"kind": "meteor", "at_s": 1}]), "faults.0.kind"),
    (changed(server={"replicas": 0}), "server.replicas"),
    (changed(server={"replicas": 2}, faults=[{"kind": "server_kill", "at_s": 1, "replica": 2}]),
     "faults.0.replica: 2 is not a replica"),
    (changed(server={"replicas": 2}, faults=[{"kind": "server_kill", "at_s": 1}]),
     "faults.0.replica: with server.replicas 2"),
    (changed(faults=[{"kind": "server_kill", "at_s": 1, "replica": 1}]), "faults.0.replica"),
    (changed(server={"replicas": 2}, faults=[{"kind": "broker_restart", "at_s": 1, "replica": 0}]),
     "faults.0.replica: only a server_kill"),
    (changed(duration_s=10), "requests and duration_s"),
    (changed(requests=None), "requests and duration_s"),
    (changed(sampling={"temprature": 0.5}), "sampling.temprature"),
    (changed(arrivals={"mode": "poisson"}), "rate_per_s"),
    (changed(surprise=1), "surprise"),
    (changed(fleet=[{"count": 1, "device": "pi5", "link": "wifi", "drafter": "calibrated:nope"}]),
     "fleet.0.drafter"),
    (changed(fleet=[{"count": 1, "device": "pi5", "link": "wifi",
                     "drafter": "calibrated:smollm2-xtok"}], sampling={"temperature": 0.7}),
     "temperature to 0"),
])
def test_a_bad_scenario_names_the_key(tmp_path, data, key):
    assert key in error_of(tmp_path, data)


def test_not_yaml_and_not_a_mapping(tmp_path):
    path = tmp_path / "broken.yaml"
    path.write_text("name: [unclosed\n")
    with pytest.raises(ScenarioError, match="not valid YAML"):
        load_scenario(path)
    path.write_text("- a list\n")
    with pytest.raises(ScenarioError, match="mapping"):
        load_scenario(path)


def test_an_unknown_name_lists_the_built_in_ones():
    with pytest.raises(ScenarioError, match="smoke"):
        load_scenario("no-such-scenario")


def test_built_in_names_resolve_to_the_shipped_files():
    assert {"smoke", "fleet16", "poisson", "faults"} <= set(builtin_scenarios())
    smoke = load_scenario("smoke")
    assert smoke.name == "smoke" and len(smoke.slots()) == 3
    assert len({slot.device for slot in smoke.slots()}) == 2
    assert {slot.drafter.split(":")[0] for slot in smoke.slots()} == {"ngram", "gguf"}
    assert {f.kind for f in smoke.faults} == {"server_kill", "link_cut"} and smoke.centralized


def test_replicas_is_two_servers_behind_the_proxy_and_kills_one():
    replicas = load_scenario("replicas")
    assert replicas.server.replicas == 2 and len(replicas.slots()) == 16
    assert [(f.kind, f.replica) for f in replicas.faults] == [("server_kill", 1)]
    assert load_scenario("smoke").server.replicas == 1


@pytest.mark.parametrize("name", builtin_scenarios())
def test_every_shipped_scenario_loads(name):
    scenario = load_scenario(name)
    assert scenario.name == name and scenario.slots()


def test_fleet16_is_the_mixed_fleet():
    slots = load_scenario("fleet16").slots()
    assert len(slots) == 16
    assert {s.device for s in slots} == {"pi4", "pi5", "orin-nano"}
    assert {s.link for s in slots} == {"wifi", "lte", "ethernet"}
    assert {s.drafter.split(":")[0] for s in slots} == {"gguf", "onnx", "ngram"}
    assert "broker_restart" in {f.kind for f in load_scenario("faults").faults}


def test_a_bad_costs_key_stops_the_scenario_before_the_run(tmp_path):
    assert "costs: unknown costs key 'watts'" in error_of(tmp_path, changed(costs={"watts": 1}))


def test_a_prompt_file_is_read_beside_the_scenario(tmp_path, monkeypatch):
    from lab.run import scenario_prompts

    (tmp_path / "prompts.txt").write_text("first prompt\n\nsecond prompt\n")
    path = write(tmp_path, changed(workload={"source": "prompts.txt"}))
    monkeypatch.chdir("/")       # not the scenario's folder
    scenario = load_scenario(path)
    assert scenario.workload.source == str(tmp_path / "prompts.txt")
    assert scenario_prompts(scenario) == ["first prompt", "second prompt"]


def test_chat_is_a_built_in_workload(tmp_path):
    from lab.run import scenario_prompts
    from lab.workload import CHAT_PROMPTS

    scenario = load_scenario(write(tmp_path, changed(workload={"source": "chat", "limit": 2})))
    assert scenario.workload.source == "chat"
    assert scenario_prompts(scenario) == CHAT_PROMPTS[:2]
