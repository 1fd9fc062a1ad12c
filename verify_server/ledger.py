"""The device ledger: what each device holds of the server, every table keyed by auth.Identity.key
(its token's device, certificate or host). Generate streams, other calls (and the server's
Health.Watch streams), GetTokenizer replies, the KV tokens its open sessions reserve against its
share of the cache, and its quotas (verify_server.quotas). A count past its bound is refused with
RESOURCE_EXHAUSTED (REASON_QUOTA) and counts nothing; a device holding nothing leaves the table.

    ledger = DeviceLedger(settings, pool, gate)
    key = ledger.count_stream(identity)           # a Generate stream, from its first byte
    ledger.uncount_stream(key)                    # ... over
    busy = ledger.tokenizer_busy(identity)        # why a GetTokenizer call cannot be served ("")
    if ledger.kv_held(key) + tokens <= ledger.kv_share_tokens():
        ledger.hold_kv(key, tokens)               # a session's KV, until release_kv
    ledger.quotas.open(identity, prompt_tokens)   # its sessions and tokens/s
"""
from __future__ import annotations

from verify_server import errors
from verify_server.auth import Gate, Identity
from verify_server.engines.blocks import BlockPool
from verify_server.errors import Reason
from verify_server.quotas import Quotas
from verify_server.settings import ServerSettings

UNLISTED_DEVICES = 4   # the KV share's parts when certificates name devices no token file lists


class DeviceLedger:
    """Per device: Generate streams, other calls, GetTokenizer replies, reserved KV tokens and
    quota usage; for the whole server: Health.Watch streams and GetTokenizer replies being
    written. The gate's grants say how many devices share the KV cache."""

    def __init__(self, settings: ServerSettings, pool: BlockPool, gate: Gate | None = None) -> None:
        self.settings = settings
        self.pool = pool
        self.gate = gate or Gate()        # who may call (auth); its grants: the KV share's parts
        self.streams: dict[str, int] = {}   # Generate streams held, by device key
        self.calls: dict[str, int] = {}     # other calls held (verify_server.call_bounds), by key
        self.watch_streams = 0              # Health.Watch streams open, all callers together
        self.tokenizer_calls = 0          # GetTokenizer replies being written (the server's slots)
        self.tokenizer_calls_of: dict[str, int] = {}   # GetTokenizer calls not over, by device key
        self.kv_reserved: dict[str, int] = {}   # KV tokens reserved by open sessions, by device key
        self.quotas = Quotas(settings.device_sessions(), settings.quota_tokens_per_s,
                             settings.quota_burst_s, settings.quota_wait_s,
                             host_sessions=settings.quota_sessions or 0)

    # --- streams and calls -----------------------------------------------------------------------

    def count_stream(self, identity: Identity) -> str:
        """One more stream of this device, from its first byte; RESOURCE_EXHAUSTED (REASON_QUOTA)
        past max_streams_per_device. Returns the key to uncount when the stream ends."""
        held, limit = self.streams.get(identity.key, 0), self.settings.max_streams_per_device
        if held >= limit:
            raise errors.exhausted(Reason.REASON_QUOTA, f"device {identity.device} holds {held} "
                                   f"Generate streams (limit {limit}): end one first")
        hold(self.streams, identity.key, 1)
        return identity.key

    def uncount_stream(self, key: str) -> None:
        release(self.streams, key, 1)

    def count_call(self, identity: Identity, watch: bool = False) -> str:
        """One more call other than Generate of this device (a Health.Watch stream: one more of
        the server's too), from its first byte; RESOURCE_EXHAUSTED past max_calls_per_device or
        max_watch_streams. Returns the key to uncount when the call ends."""
        held, limit = self.calls.get(identity.key, 0), self.settings.max_calls_per_device
        if held >= limit:
            raise errors.exhausted(Reason.REASON_QUOTA, f"device {identity.device} holds {held} "
                                   f"calls (limit {limit}): end one first")
        if watch and self.watch_streams >= self.settings.max_watch_streams:
            raise errors.exhausted(Reason.REASON_QUOTA, f"{self.watch_streams} Health.Watch "
                                   f"streams are open (limit {self.settings.max_watch_streams}): "
                                   "use Health.Check, or retry later")
        hold(self.calls, identity.key, 1)
        self.watch_streams += watch
        return identity.key

    def uncount_call(self, key: str, watch: bool = False) -> None:
        release(self.calls, key, 1)
        self.watch_streams -= watch

    # --- GetTokenizer replies ----------------------------------------------------------------

    def tokenizer_busy(self, identity: Identity) -> str:
        """Why a GetTokenizer call cannot be served now ("" when it can)."""
        held = self.tokenizer_calls_of.get(identity.key, 0)
        if identity.authenticated:
            caller, per = f"device {identity.device}", "per device"
            share = self.settings.max_tokenizer_calls_per_device
        else:                   # a host's devices cannot be told apart: a NAT's are one
            caller, per = identity.key, "per host without a token or certificate"
            share = self.settings.max_tokenizer_calls_per_host
        if held >= share:
            return (f"{caller} holds {held} GetTokenizer replies (limit {share} {per}): read or "
                    "end them first")
        limit = self.settings.max_tokenizer_calls
        if self.tokenizer_calls >= limit:
            return (f"{self.tokenizer_calls} GetTokenizer replies are being sent (limit {limit}): "
                    "retry in a moment")
        return ""

    def tokenizer_call_started(self, key: str) -> None:
        """A reply takes one of the server's slots and counts against its device until over."""
        self.tokenizer_calls += 1
        hold(self.tokenizer_calls_of, key, 1)

    def tokenizer_reply_written(self) -> None:
        """Nothing more of a reply is written: its slot is free (the call may not be over)."""
        self.tokenizer_calls -= 1

    def tokenizer_call_over(self, key: str) -> None:
        release(self.tokenizer_calls_of, key, 1)

    # --- each device's share of the KV cache -------------------------------------------------

    def kv_held(self, key: str) -> int:
        """KV tokens the device's open sessions reserve."""
        return self.kv_reserved.get(key, 0)

    def hold_kv(self, key: str, tokens: int) -> None:
        hold(self.kv_reserved, key, tokens)

    def release_kv(self, key: str, tokens: int) -> None:
        release(self.kv_reserved, key, tokens)

    def kv_share_tokens(self) -> int:
        """KV tokens one device may reserve, in whole blocks: kv_share of the budget, by default
        an equal part for each device of the token file, a part of UNLISTED_DEVICES for devices
        told apart by client certificates without one, all of it when only hosts tell them apart
        (a NAT's devices are one)."""
        share = self.settings.kv_share
        if share is None:
            share = 1.0 / self._devices_sharing_kv()
        block = self.pool.block_tokens
        return max(int(self.pool.capacity_tokens * share) // block, 1) * block

    def _devices_sharing_kv(self) -> int:
        if self.gate.required:
            return max(len(self.gate.grants), 1)
        return UNLISTED_DEVICES if self.gate.certificates else 1


def hold(table: dict[str, int], key: str, amount: int) -> None:
    """What a device holds (streams, tokenizer calls, KV tokens) grows by amount."""
    table[key] = table.get(key, 0) + amount


def release(table: dict[str, int], key: str, amount: int) -> None:
    """... and shrinks; a device holding nothing leaves the table."""
    left = table.pop(key, 0) - amount
    if left > 0:
        table[key] = left
