"""Who is calling: a device's identity from its bearer token and, under mutual TLS, its
certificate. Every Verifier call passes the gate first; the health service never does. Every
call, health and reflection included, is counted against its caller (Gate.caller: its token's
device, else its certificate's name, else its host's address block) by
verify_server.call_bounds. Behind a trusted proxy the certificate name and the host are the ones
the proxy forwards (verify_server.origin): a header never outweighs a token.

The token file (`sled serve --auth-tokens FILE`), one device a line, re-read on SIGHUP:

    # DEVICE_ID TOKEN [cert=NAME] [sessions=N] [tokens_per_s=R]
    cam-3   q2VhZ...                                   a token alone
    dev-1   Xk2pL...   cert=dev-1  sessions=4          pinned to dev-1's client certificate,
                                                       at most 4 open sessions

    gate = Gate(Path("tokens"), client_certs=True)
    identity = gate.identify(context.invocation_metadata(), context.auth_context(), context.peer())
    identity.device, identity.quota                    # "dev-1", Quota(sessions=4, ...)
    gate.reload()                                      # SIGHUP: revoke or add devices

Tokens are compared as SHA-256 digests with hmac.compare_digest against every line, so the time
a check takes says nothing about which token came close. A file that does not read on reload
leaves the previous table in force (one log line says why).
"""
from __future__ import annotations

import hashlib
import hmac
import logging
import time
from dataclasses import dataclass
from pathlib import Path

from sled.wire.auth import bearer_token
from sled.wire.topics import check_topic_level
from sled.printable import printable
from verify_server import errors
from verify_server.origin import CERT_HEADER, NAME_CHARS, CallerPrefixes, Origin, TrustedProxies

log = logging.getLogger("sled.server.auth")

ANONYMOUS = "anonymous"        # the device name of a call when the server asks for no identity
OPTIONS = ("cert", "sessions", "tokens_per_s")
WARN_EVERY_S = 10.0            # unknown tokens are logged at most this often (anyone can send one)


def access_of(settings) -> tuple["Gate", object]:
    """The gate every Verifier call passes and the TLS credentials (None: plaintext) that the
    server settings ask for; a file that cannot be used raises ValueError (TokenFileError,
    TlsFileError) with one line. sled serve calls it before the target loads."""
    # here, not at the top: tls reads the server's settings (pydantic), which a process that
    # only handles sessions' identities (the engine bench on a GPU box) does without
    from verify_server.tls import server_credentials

    credentials = server_credentials(settings)
    tokens = Path(settings.auth_tokens) if settings.auth_tokens else None
    proxies = TrustedProxies(settings.trusted_proxies, settings.proxy_cert_header)
    prefixes = CallerPrefixes(settings.caller_prefix_v4, settings.caller_prefix_v6,
                              settings.loopback_one_caller)
    gate = Gate(tokens, client_certs=bool(settings.tls_client_ca), proxies=proxies,
                require_identity=settings.require_identity, prefixes=prefixes)
    pinned = [grant.device for grant in gate.grants if grant.cert is not None]
    if pinned and not gate.certificates:
        raise TokenFileError(f"the token file {tokens} pins {len(pinned)} tokens to client "
                             f"certificates (cert=..., e.g. {pinned[0]}), which only mutual TLS "
                             "proves: add --tls-client-ca (or --trusted-proxy and "
                             f"--proxy-cert-header {CERT_HEADER}, the header a proxy that "
                             "verifies them sets), or drop the cert= options")
    return gate, credentials


class TokenFileError(ValueError):
    """The token file cannot be used; the message names the file and line (never the token)."""


@dataclass(frozen=True, slots=True)
class Quota:
    """A device's own limits from its token line (None: the server's defaults)."""
    sessions: int | None = None
    tokens_per_s: float | None = None


@dataclass(frozen=True, slots=True)
class Grant:
    """What one token line grants."""
    device: str
    digest: bytes                   # SHA-256 of the token
    cert: str | None = None         # the client certificate name the token is pinned to
    quota: Quota = Quota()

    def identity(self) -> "Identity":
        """The device this token proves."""
        return Identity(self.device, True, "device:" + self.device, self.quota)


@dataclass(frozen=True, slots=True)
class Identity:
    """Who a call comes from. `key` tells devices apart for quotas and bounds: the device id
    when it was proven, else its host's address block (CallerPrefixes: what one machine may
    hold). `tenant` scopes its prefix cache (verify_server.tenant): the proven device's, else
    its host's own address, as one block (an IPv6 LAN's /64) holds many devices and a hit tells
    what another sent. Left out, the tenant is the key."""
    device: str
    authenticated: bool
    key: str
    quota: Quota = Quota()
    tenant: str = ""

    def __post_init__(self) -> None:
        if not self.tenant:
            object.__setattr__(self, "tenant", self.key)


def digest(token: str) -> bytes:
    return hashlib.sha256(token.encode("utf-8", "surrogatepass")).digest()


def read_token_file(path: Path) -> list[Grant]:
    """The grants of a token file; TokenFileError for a line that does not read."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise TokenFileError(f"cannot read the token file {path}: "
                             f"{getattr(exc, 'strerror', None) or exc}") from None
    grants, seen = [], set()
    for number, line in enumerate(text.splitlines(), 1):
        words = line.split("#", 1)[0].split()
        if not words:
            continue
        grant = _grant(words, f"{path}:{number}")
        if grant.device in seen or any(g.digest == grant.digest for g in grants):
            raise TokenFileError(f"{path}:{number}: device {grant.device} or its token is "
                                 "listed twice")
        seen.add(grant.device)
        grants.append(grant)
    return grants


def _grant(words: list[str], where: str) -> Grant:
    """One line's words: DEVICE_ID TOKEN [key=value ...]."""
    if len(words) < 2:
        raise TokenFileError(f"{where}: expected DEVICE_ID TOKEN [cert=NAME] [sessions=N] "
                             "[tokens_per_s=R]")
    device, token, options = words[0], words[1], {}
    try:
        check_topic_level(device, "the device id")
    except ValueError as exc:
        raise TokenFileError(f"{where}: {exc}") from None
    if len(token) < 16:
        raise TokenFileError(f"{where}: the token of {device} is shorter than 16 characters "
                             "(sled certs makes 43)")
    for word in words[2:]:
        key, _, value = word.partition("=")
        if key not in OPTIONS or not value:
            raise TokenFileError(f"{where}: unknown option {printable(word, 60)!r} (use "
                                 + ", ".join(f"{o}=..." for o in OPTIONS) + ")")
        options[key] = value
    return Grant(device, digest(token), options.get("cert"), _quota(options, where))


def _quota(options: dict[str, str], where: str) -> Quota:
    try:
        sessions = int(options["sessions"]) if "sessions" in options else None
        rate = float(options["tokens_per_s"]) if "tokens_per_s" in options else None
    except ValueError as exc:
        raise TokenFileError(f"{where}: {exc}") from None
    if (sessions is not None and sessions < 1) or (rate is not None and not rate > 0):
        raise TokenFileError(f"{where}: sessions must be >= 1 and tokens_per_s > 0")
    return Quota(sessions, rate)


def certificate_names(auth_context: dict) -> list[str]:
    """The names a verified client certificate carries (common name, then DNS names)."""
    names = []
    for key in ("x509_common_name", "x509_subject_alternative_name"):
        for value in auth_context.get(key, ()):
            name = value.decode("utf-8", "replace") if isinstance(value, bytes) else str(value)
            name = printable(name, NAME_CHARS)     # it names the device in logs and metrics
            if name not in names:
                names.append(name)
    return names


def tokenless_identity(origin: Origin, prefixes: CallerPrefixes = CallerPrefixes()) -> Identity:
    """A caller without a token: its certificate's first name, else its host's address block
    ("host:2001:db8:1:2::/64", "host:loopback", "host:203.0.113.7") with the host's own
    address as its prefix-cache tenant ("host:2001:db8:1:2::7")."""
    if origin.names:
        return Identity(origin.names[0], True, "cert:" + origin.names[0])
    return Identity(ANONYMOUS, False, "host:" + prefixes.caller(origin.host),
                    tenant="host:" + origin.host)


class Gate:
    """Checks each call's identity: a known token when there is a token file, a client
    certificate the CA signed under mutual TLS (checked by the TLS handshake itself), or the
    one a trusted proxy verified. `require_identity`: a call that neither a token nor a
    certificate names is refused, rather than known by its host's address block (`prefixes`)."""

    def __init__(self, tokens: Path | None = None, client_certs: bool = False,
                 proxies: TrustedProxies | None = None, require_identity: bool = False,
                 prefixes: CallerPrefixes = CallerPrefixes()) -> None:
        self.path = tokens
        self.client_certs = client_certs
        self.proxies = proxies or TrustedProxies()
        self.require_identity = require_identity
        self.prefixes = prefixes
        self.grants = read_token_file(tokens) if tokens is not None else []
        self.unknown_tokens, self.warned_at = 0, float("-inf")   # since the last warning
        self.unnamed_calls, self.unnamed_warned_at = 0, float("-inf")

    @property
    def required(self) -> bool:
        return self.path is not None

    @property
    def certificates(self) -> bool:
        """Whether certificates name devices: mutual TLS, or a trusted proxy's header."""
        return self.client_certs or self.proxies.name_devices

    def origin(self, metadata, auth_context: dict, peer: str) -> Origin:
        """Where the call comes from (verify_server.origin): the one place a caller's host and
        certificate names are read."""
        names = certificate_names(auth_context) if self.client_certs else []
        return self.proxies.origin(metadata, peer, names)

    def reload(self) -> bool:
        """Read the token file again (SIGHUP); on failure keep the table in force."""
        if self.path is None:
            return False
        try:
            grants = read_token_file(self.path)
        except TokenFileError as exc:
            log.error("%s; the %d tokens read before stay in force", exc, len(self.grants))
            return False
        gone = {g.device for g in self.grants} - {g.device for g in grants}
        self.grants = grants
        log.info("token file %s re-read: %d devices%s", self.path, len(grants),
                 f", revoked: {', '.join(sorted(gone))}" if gone else "")
        return True

    def identify(self, metadata, auth_context: dict, peer: str) -> Identity:
        """The caller's identity, or a SessionError (UNAUTHENTICATED, PERMISSION_DENIED)."""
        origin = self.origin(metadata, auth_context, peer)
        if not self.required:
            return self._tokenless(origin)
        grant = self._grant_of(bearer_token(metadata), origin)
        names = origin.names
        if grant.cert is not None and grant.cert not in names:
            carried = f"carries {printable(', '.join(names), 200)}" if names else "carries none"
            raise errors.denied(f"device {grant.device}'s token is pinned to the client "
                                f"certificate {grant.cert!r}; this connection {carried}")
        return grant.identity()

    def caller(self, metadata, auth_context: dict, peer: str) -> Identity:
        """Who a call is from for the bounds every call passes (verify_server.call_bounds),
        never refused and never logged (health and reflection need no token): the device its
        token proves (over its pinned certificate), else its certificate's name, else its host."""
        origin = self.origin(metadata, auth_context, peer)
        grant = self._known(bearer_token(metadata)) if self.required else None
        if grant is not None and (grant.cert is None or grant.cert in origin.names):
            return grant.identity()
        return tokenless_identity(origin, self.prefixes)

    def _tokenless(self, origin: Origin) -> Identity:
        """A call without a token (none asked for): its certificate's name, else its host;
        refused under require_identity when no certificate names it."""
        identity = tokenless_identity(origin, self.prefixes)
        if identity.authenticated:
            return identity
        if self.require_identity:
            raise errors.unauthenticated(
                "this server serves only devices that a client certificate names "
                "(--require-identity) and this call carries none: dial with --client-cert and "
                "--client-key (through a proxy, one that verifies them and forwards the name)")
        if origin.unnamed:
            self._warn_unnamed(origin)
        return identity

    def _known(self, token: str | None) -> Grant | None:
        """The grant of a token, every line compared (no early exit); None: no such token."""
        if token is None:
            return None
        presented, found = digest(token), None
        for grant in self.grants:
            if hmac.compare_digest(presented, grant.digest):
                found = grant
        return found

    def _grant_of(self, token: str | None, origin: Origin) -> Grant:
        if token is None:
            raise errors.unauthenticated("this server wants a device token: send the metadata "
                                  "'authorization: Bearer TOKEN' (sled device --token, "
                                  "sled generate --token)")
        found = self._known(token)
        if found is None:
            self._warn_unknown(origin)
            raise errors.unauthenticated("the device token is not known to this server (revoked or "
                                  "mistyped): ask its operator for a valid one")
        return found

    def _warn_unknown(self, origin: Origin) -> None:
        """One warning line per WARN_EVERY_S at most, with how many came since the last."""
        self.unknown_tokens += 1
        now = time.monotonic()
        if now - self.warned_at >= WARN_EVERY_S:
            log.warning("unknown or revoked token from %s (%d such calls since the last "
                        "warning)", origin, self.unknown_tokens)
            self.unknown_tokens, self.warned_at = 0, now

    def _warn_unnamed(self, origin: Origin) -> None:
        """A trusted proxy that forwards neither its client's address nor its certificate: its
        devices are one, said at most once per WARN_EVERY_S."""
        self.unnamed_calls += 1
        now = time.monotonic()
        if now - self.unnamed_warned_at >= WARN_EVERY_S:
            log.warning("%d calls through the trusted proxy %s carried neither x-forwarded-for nor "
                        "%s: its devices share one quota and prefix cache (have it set "
                        "x-forwarded-for, or start with --require-identity to refuse them)",
                        self.unnamed_calls, origin.proxy,
                        self.proxies.cert_header or "a certificate header")
            self.unnamed_calls, self.unnamed_warned_at = 0, now

