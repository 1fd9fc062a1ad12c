"""`sled lab run SCENARIO`: run a scenario locally (sled serve, Mosquitto, one sled device per
device) or in compose, sled and the centralized baseline, then write the report."""
from __future__ import annotations

import argparse


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("scenario", help="a built-in scenario (smoke, fleet16, poisson, faults) "
                                         "or a path to a scenario YAML file")
    parser.add_argument("--out", default="lab-results", metavar="DIR",
                        help="where the run's folder goes (default: lab-results)")
    parser.add_argument("--fleet", choices=("local", "compose"), default="local",
                        help="processes on this machine, or Docker Compose (default: local)")
    parser.add_argument("--run", default=None, metavar="NAME",
                        help="the run's folder name under --out (default: scenario and time)")


def run(args: argparse.Namespace) -> int:
    print("sled lab run: not ready yet")
    return 2
