"""Assemble and run the verify server: gRPC (aio) with health and reflection, plus metrics."""
from __future__ import annotations

import asyncio
import errno
import logging
import signal
import socket
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from sled.v1 import verifier_pb2 as pb
from verify_server.auth import access_of
from verify_server.call_bounds import CallBounds
from verify_server.engines import make_engine
from verify_server.engines.base import Engine
from verify_server.engines.blocks import KVShape
from verify_server.engines.emulated import EmulatedEngine
from verify_server.engines.sharded import Channel, LeadingEngine
from verify_server.gpu_memory import describe, gpu_memory
from verify_server.metrics import Metrics
from verify_server.scheduler import Scheduler
from verify_server.service import VerifierService
from verify_server.settings import ServerSettings
from verify_server.step_costs import StepProfile, load_profile
from verify_server.target import Target
from verify_server.transport import Undecodable

if TYPE_CHECKING:
    from verify_server.announce import AnnounceConfig
    from verify_server.ranks import Ranks

log = logging.getLogger("sled.server")
SERVICE_NAME = pb.DESCRIPTOR.services_by_name["Verifier"].full_name


@dataclass
class RunningServer:
    server: grpc.aio.Server
    port: int
    service: VerifierService
    scheduler: Scheduler
    metrics: Metrics
    health: health.aio.HealthServicer
    evictions: asyncio.Task | None = None

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    async def stop(self, grace: float | None = 1.0) -> None:
        self.service.core.accepting = False
        await self.health.enter_graceful_shutdown()
        await self.server.stop(grace)
        if self.evictions is not None:
            self.evictions.cancel()
        await self.scheduler.stop()
        self.scheduler.engine.close()    # a split server's other ranks stop


def _emulated(engine: Engine, profile: StepProfile | None,
              metrics: Metrics) -> Engine | EmulatedEngine:
    """Emulating a profiled GPU (--emulate): the engine, each step held to the profile's time."""
    if profile is None:
        return engine
    log.info("emulating %s: every step held to the profile's time, overruns counted in "
             "sled_emulated_overruns", profile.describe())
    return EmulatedEngine(engine, profile, metrics)


def _kv_budget(settings: ServerSettings, profile: StepProfile | None,
               target: Target) -> int | None:
    """The KV pool's bytes: the profiled GPU's KV capacity in tokens of this target, when the
    profile knows its GPU's memory (verify_server.gpu_memory); else --kv-budget (None: a share
    of free memory)."""
    if profile is None:
        return settings.kv_budget
    gpu = gpu_memory(profile)
    log.info("KV held to the profiled GPU's memory: %s", describe(profile, gpu))
    tokens = gpu.kv_tokens()
    if tokens is None:
        return settings.kv_budget
    block = settings.kv_block_tokens
    blocks = -(-tokens // block) + 1        # and the zero block
    return blocks * block * KVShape.of(target.model).bytes_per_token


def windowed(pool) -> str:
    """How a windowed pool keeps its layers' KV, for the start-up line ("" without windows)."""
    if not pool.windowed:
        return ""
    windows = sorted({g.window for g in pool.groups if g.window is not None})
    return (f"; {len(pool.groups)} layer groups of {pool.shape.group_layers} layers, sliding "
            f"windows of {', '.join(map(str, windows))} tokens keep only their window (a pool "
            "token is one slot of one group)")


async def start_server(target: Target, settings: ServerSettings | None = None,
                       host: str = "127.0.0.1", port: int = 0,
                       metrics: Metrics | None = None, ranks: Ranks | None = None) -> RunningServer:
    """Start serving `target` with `settings` (its limits and KV pool; the address is `host` and
    `port`: port 0 picks a free port, see RunningServer.port). With `ranks`, this is rank 0 of
    a server split over them (verify_server.ranks): its engine leads theirs (follow_leader)."""
    settings = settings or ServerSettings()
    metrics = metrics or Metrics()
    if port and _in_use(host, port):   # before the KV pool is taken
        raise OSError(f"port {host}:{port} is in use")
    gate, credentials = access_of(settings)   # a bad file stops start-up before the KV pool
    gate.proxies.warn_wide()
    target.cap_context(settings.context_length)
    if target.sat is not None:
        target.sat.check(target.model)
    profile = load_profile(settings.emulate) if settings.emulate else None
    engine = _engine(target, settings, profile, ranks)
    metrics.watch_pool(engine.pool)
    _warm_up(engine, settings)
    scheduler = Scheduler(_emulated(engine, profile, metrics), metrics,
                          settings.max_batch_sessions, settings.max_step_tokens,
                          {"auto": None, "on": True, "off": False}[settings.overlap_steps])
    scheduler.start()
    service = VerifierService(target, scheduler, settings, metrics, gate)
    server = grpc.aio.server(interceptors=[CallBounds(service.core)], options=[
        ("grpc.max_receive_message_length", settings.receive_limit(target.context_length)),
        ("grpc.so_reuseport", 0),      # a second server on a used port fails, never shares it
        # what one connection holds, refused calls its client never reads included, is bounded
        ("grpc.max_concurrent_streams", settings.max_streams_per_connection),
    ])
    add_verifier(service, server)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    for name in ("", SERVICE_NAME):
        await health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
    if settings.reflection:
        reflection.enable_server_reflection(
            (SERVICE_NAME, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name,
             reflection.SERVICE_NAME), server)
    try:
        bound = _bind(server, host, port, credentials)
    except OSError:
        await scheduler.stop()
        raise
    await server.start()
    log.info("serving %s on %s:%d (%s; %s)", target.model_id, host, bound, describe_access(settings),
             describe_sat(target.sat))
    evictions = asyncio.get_running_loop().create_task(service.core.run_evictions(),
                                                       name="sled-evictions")
    return RunningServer(server, bound, service, scheduler, metrics, health_servicer, evictions)


def _engine(target: Target, settings: ServerSettings, profile: StepProfile | None,
            ranks: Ranks | None) -> Engine | LeadingEngine:
    """The engine over the KV pool the settings (or the profiled GPU) ask for; with `ranks`,
    rank 0's, leading the other ranks' (the pool sized by their least free memory)."""
    budget = _kv_budget(settings, profile, target)
    if ranks is not None:      # the ranks' least free memory (each rank asks: a collective)
        shared = ranks.kv_budget(target.device, settings.kv_fraction)
        budget = shared if budget is None else budget
    engine = make_engine(target.model, kv_budget_bytes=budget,
                         kv_fraction=settings.kv_fraction, block_tokens=settings.kv_block_tokens,
                         kind=settings.engine, sat=target.sat, flex_splits=settings.flex_splits,
                         windows=settings.kv_windows and profile is None,
                         row_tokens=settings.max_step_tokens)
    if ranks is not None:
        engine = LeadingEngine(engine, Channel(ranks.group))
        log.info("split over %d ranks (tensor parallel): the KV pool below is theirs together",
                 ranks.size)
    log.info("%s engine, KV pool %d tokens (%.0f MiB)%s", engine.kind,
             engine.pool.capacity_tokens, engine.pool.nbytes / (1 << 20), windowed(engine.pool))
    return engine


def _warm_up(engine: Engine | LeadingEngine, settings: ServerSettings) -> None:
    """What the first steps would compile or capture (the flex engine: its buckets, its flex),
    before serving; said when it took a while."""
    started = time.perf_counter()
    engine.warm_up(settings.max_batch_sessions, settings.max_step_tokens)
    if time.perf_counter() - started > 1:
        log.info("%s engine warmed up in %.1f s", engine.kind, time.perf_counter() - started)


def describe_access(settings: ServerSettings) -> str:
    """One phrase for the start-up line: what a client must bring."""
    transport = ("mutual TLS" if settings.tls_client_ca else "TLS") if settings.tls_cert \
        else "plaintext"
    who = "device tokens" if settings.auth_tokens else "no device tokens"
    if settings.auth_tokens and not settings.tls_cert:
        log.warning("device tokens travel in clear without TLS: give --tls-cert and --tls-key")
    return f"{transport}, {who}"


def add_verifier(service: VerifierService, server: grpc.aio.Server) -> None:
    """Register the Verifier as the generated code does, but with request decoders that never
    raise: undecodable bytes arrive as an Undecodable, which the service refuses with
    INVALID_ARGUMENT (a raising decoder would end the call with UNKNOWN)."""
    handlers = {
        "GetModelInfo": grpc.unary_unary_rpc_method_handler(
            service.GetModelInfo, request_deserializer=_decoder(pb.GetModelInfoRequest),
            response_serializer=pb.ModelInfo.SerializeToString),
        "GetTokenizer": grpc.unary_stream_rpc_method_handler(
            service.GetTokenizer, request_deserializer=_decoder(pb.GetTokenizerRequest),
            response_serializer=_encoded),
        "Generate": grpc.stream_stream_rpc_method_handler(
            service.Generate, request_deserializer=_decoder(pb.DeviceMessage),
            response_serializer=pb.ServerMessage.SerializeToString),
    }
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE_NAME, handlers),))
    server.add_registered_method_handlers(SERVICE_NAME, handlers)


def _decoder(message_type):
    """bytes -> message_type, or an Undecodable saying why (the bytes are not kept)."""
    name = message_type.DESCRIPTOR.name

    def decode(data: bytes):
        try:
            return message_type.FromString(data)
        except Exception as exc:   # DecodeError, or anything else the parser raises
            return Undecodable(name, len(data), str(exc))
    return decode


def _encoded(reply) -> bytes:
    """A reply encoded once ahead (bytes, as they are) or a message to encode now."""
    return reply if isinstance(reply, bytes) else reply.SerializeToString()


def _bind(server: grpc.aio.Server, host: str, port: int,
          credentials: grpc.ServerCredentials | None = None) -> int:
    """Listen on host:port (with TLS given credentials); OSError with one line if that cannot
    be done (e.g. a used port)."""
    address = f"{host}:{port}"
    try:   # the probe first spares the log grpc writes when its own bind fails
        if port and _in_use(host, port):
            bound = 0
        elif credentials is not None:
            bound = server.add_secure_port(address, credentials)
        else:
            bound = server.add_insecure_port(address)
    except RuntimeError:
        bound = 0
    if bound == 0:
        raise OSError(f"port {host}:{port} is in use" if _in_use(host, port)
                      else f"cannot listen on {host}:{port}")
    return bound


def _in_use(host: str, port: int) -> bool:
    """Whether something already listens on host:port (a bind, as grpc's, says so)."""
    try:
        with socket.socket(socket.AF_INET6 if ":" in host.strip("[]") else socket.AF_INET) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)   # TIME_WAIT is no use
            probe.bind((host.strip("[]"), port))
    except OSError as exc:
        return exc.errno == errno.EADDRINUSE
    return False


async def serve_forever(target: Target, settings: ServerSettings,
                        announce: AnnounceConfig | None = None, ranks: Ranks | None = None) -> None:
    """Serve on settings.host:settings.port until interrupted (metrics on settings.metrics_port);
    with `announce`, also announce the server over MQTT; with `ranks`, as rank 0 of them."""
    host = settings.host
    running = await start_server(target, settings, host, settings.port, ranks=ranks)
    if settings.auth_tokens:   # revoke or add devices without a restart
        gate = running.service.core.ledger.gate
        asyncio.get_running_loop().add_signal_handler(signal.SIGHUP, gate.reload)
    if settings.metrics_port is not None:
        try:
            http, _ = running.metrics.serve_http(settings.metrics_port, addr=host)
        except OSError as exc:
            await running.stop(grace=0)
            why = ("is in use" if exc.errno == errno.EADDRINUSE
                   else f"cannot be used ({exc.strerror})")
            raise OSError(f"metrics port {host}:{settings.metrics_port} {why}") from None
        # port 0 asks for a free port: say the one it got
        log.info("metrics on http://%s:%d/metrics", host, http.server_address[1])
    announcing = None
    if announce is not None:
        from verify_server.announce import Announcer

        announcing = asyncio.get_running_loop().create_task(
            Announcer(running.service, announce).run(), name="sled-announce")
    try:
        await running.server.wait_for_termination()
    finally:
        if announcing is not None:   # says offline before the port closes
            announcing.cancel()
            await asyncio.gather(announcing, return_exceptions=True)
        await running.stop()


def describe_sat(sat) -> str:
    """The target's SATs in a log line: "no SATs", or slots, kind and source."""
    if sat is None:
        return "no SATs"
    source = f" from {Path(sat.source).name}" if sat.source else ""
    return f"{sat.slots} SAT slots, {sat.kind}{source}"
