"""The child process of `sled bench startup` (lab.bench.startup): one start of the server's
target, a drafter or the device's copy of the target's tokenizer, timed phase by phase.

Its imports are the ones it times: this module itself imports nothing of sled at its top, so the
child's clock starts before any of them (lab.bench.startup imports the bench harness, which
imports much of what the commands do)."""
from __future__ import annotations

import asyncio
import json
import time

SERVER_PHASES = ["imports", "gguf.assemble", "target.convert", "target.tokenizer",
                 "target.weights", "target.rest", "total"]
DRAFTER_PHASES = ["imports", "gguf.assemble", "drafter", "drafter.fingerprint", "total"]
DEVICE_PHASES = ["imports", "device.tokenizer", "total"]


def child(kind: str, spec: str) -> None:
    """In the child: start the server's target or the drafter as the commands do, then print the
    phases' seconds as one JSON line."""
    start = time.perf_counter()
    # what follows is the imports phase: imported here, after the clock starts, not at the top
    from sled import progress

    if kind == "server":
        from verify_server.target import load_target
        from verify_server.server import serve_forever  # noqa: F401  (serve's imports)
        from verify_server.settings import ServerSettings

        imported = time.perf_counter() - start
        load_target(ServerSettings(model=spec))
    elif kind == "device":
        from edge_client.connection import Connection  # noqa: F401  (generate's imports)

        imported = time.perf_counter() - start
        progress.TIMINGS.append(("device.tokenizer", _device_tokenizer(spec)))
    else:
        from drafters import load_drafter
        from edge_client.session import generate  # noqa: F401  (generate's imports)

        imported = time.perf_counter() - start
        load_drafter(spec).tokenizer_fingerprint
    phases = {"imports": imported}
    for key, seconds in progress.TIMINGS:
        phases[key] = phases.get(key, 0.0) + seconds
    phases["total"] = time.perf_counter() - start
    if kind == "server":
        loaded = sum(phases.get(key, 0.0) for key in SERVER_PHASES[:5])
        phases["target.rest"] = phases["total"] - loaded
    print(json.dumps(phases))


def _device_tokenizer(address: str) -> float:
    """Seconds for the target's model info and tokenizer (from the device's cache once fetched)."""
    from edge_client.connection import Connection   # not at the top: child() times its import

    async def load() -> float:
        start = time.perf_counter()
        async with Connection(address) as conn:
            await conn.tokenizer()
        return time.perf_counter() - start

    return asyncio.run(load())
