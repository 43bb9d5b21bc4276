"""Who may call what: API keys with scopes, the agents they may use, and per-key quotas.

Keys are configured as SHA-256 digests (``auth.keys``; ``kaizen key new`` makes one). A presented
key is hashed and compared with every configured digest in constant time, so neither the config
nor the timing reveals a key. Each route needs a scope (``chat``, ``feedback``, ``read``,
``admin``); a key limited to some agents gets 403 for any other agent's model or experiences. Quotas
are token buckets per key (requests and tokens a minute), refilled continuously; an empty bucket
answers 429 with the seconds until it holds enough again in Retry-After. They are counted in the
buffer's database (``SharedQuotas``, the default: one bucket per key for every replica on it) or in
this process (``Quotas``).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import hashlib
import hmac
import logging
import secrets
import threading
import time
from dataclasses import dataclass, field
from typing import Literal

from pydantic import Field, model_validator
from sqlalchemy.exc import SQLAlchemyError

from services.common import buffer
from services.common.checkpoints import AGENT_NAME
from services.common.config import ConfigModel
from services.common.http.errors import APIError

log = logging.getLogger(__name__)

ANONYMOUS = "anonymous"  # the actor when no keys are configured
SCOPES = ("chat", "feedback", "read", "admin")


class ApiKeySection(ConfigModel):
    """One API key, stored as its SHA-256 (``kaizen key new`` makes a key and prints this entry)."""

    name: str = Field(min_length=1, max_length=128, description="Who holds it: the audit log and metrics name it.")
    sha256: str = Field(pattern=r"^[0-9a-f]{64}$", description="Hex SHA-256 of the key; the key itself is never stored.")
    scopes: list[Literal["chat", "feedback", "read", "admin"]] = Field(
        default_factory=lambda: ["chat", "feedback"],
        description="chat: the model APIs and /v1/models; feedback: /feedback, /commit, /demonstrations; read: "
        "/experiences, /versions, /metrics, /openapi.json, /v1/models; admin: /admin/* (rollback, release decisions, "
        "the audit log) and deleting experiences.",
    )
    agents: list[str] | None = Field(default=None, description="The agents it may use (chat, feedback, commits); absent: all.")
    requests_per_min: int | None = Field(default=None, ge=1, description="Requests a minute before 429 (absent: no limit).")
    tokens_per_min: int | None = Field(
        default=None, ge=1, description="Prompt and completion tokens a minute before 429 (absent: no limit).")
    train: bool = Field(default=True, description="Whether its traffic may be trained on (metadata.train overrides per request).")


class AuthSection(ConfigModel):
    keys: list[ApiKeySection] = Field(default_factory=list, description="API keys, hashed, with scopes, agents and quotas.")
    api_keys: list[str] = Field(
        default_factory=list,
        description="Plain keys with every scope (older configs; prefer keys, which are stored hashed). Empty, with "
        "no keys either: no auth.",
    )
    quotas: Literal["database", "process"] = Field(
        default="database",
        description="Where keys' quotas are counted. database: in the buffer's database, one bucket per key for "
        "every Explorer replica on it (each admission one short write transaction; while the database is "
        "unreachable each replica counts on its own). process: in each process (a key gets its quota per replica). "
        "The dashboard, which only reads the database, always counts in its process.")
    quota_hold_s: float = Field(
        default=900.0, gt=0,
        description="A running request's hold on its key's token quota lapses after this long if it was never "
        "settled (its replica died): longer than any request may run.")

    @model_validator(mode="after")
    def _unique(self) -> "AuthSection":
        names = [k.name for k in self.keys]
        if len(set(names)) != len(names):
            raise ValueError("auth.keys: each key needs a name of its own")
        for k in self.keys:
            if k.name in ("anonymous", "release-gate") or k.name.startswith("api_keys["):
                raise ValueError(f"auth.keys: the name {k.name!r} is reserved")
            for agent in k.agents or ():
                if not AGENT_NAME.match(agent):
                    raise ValueError(f"auth.keys[{k.name}].agents: invalid agent name {agent!r}")
        return self


def key_digest(key: str) -> str:
    return hashlib.sha256(key.strip().encode()).hexdigest()


def presented_key(headers) -> str:
    """The key a request presents: ``Authorization: Bearer <key>``, else ``X-Api-Key`` (as Anthropic's
    clients send it); "" when neither."""
    scheme, _, token = headers.get("authorization", "").partition(" ")
    if scheme.lower() != "bearer" or not token:
        token = headers.get("x-api-key", "")
    return token


def new_key() -> str:
    return "kz-" + secrets.token_urlsafe(32)


@dataclass(frozen=True)
class Principal:
    """The holder of a key, as the routes see it."""

    name: str
    scopes: frozenset[str]
    agents: frozenset[str] | None = None  # None: every agent
    train: bool = True  # the default of metadata.train for its traffic
    requests_per_min: int | None = None
    tokens_per_min: int | None = None

    def may_use(self, agent: str | None) -> bool:
        return self.agents is None or agent in self.agents

    @property
    def agent_list(self) -> list[str] | None:
        return None if self.agents is None else sorted(self.agents)


@dataclass
class _Bucket:
    capacity: float
    level: float
    stamp: float = field(default_factory=time.monotonic)
    held: float = 0.0  # reserved by requests still running (tokens only): charged to level when they end

    def refill(self, now: float) -> None:
        self.level = min(self.capacity, self.level + (now - self.stamp) * self.capacity / 60.0)
        self.stamp = now

    def wait_s(self, need: float) -> float:
        return max(0.0, (need - self.level) * 60.0 / self.capacity)


class Quotas:
    """Requests and tokens a minute per key. A request is admitted while its key's token bucket is
    not empty; once its prompt is rendered, a model request reserves its tokens up front (the prompt
    and the most it may generate, ``reserve_tokens``): it waits while what the bucket holds, less
    what running requests reserved, cannot cover them. When it ends, what it used is charged
    (``settle_tokens``). So a burst of concurrent requests cannot overshoot the quota by more than
    one request's worth, and a reservation never locks the key out of the other endpoints (their
    check looks at what was charged). A request larger than the whole quota is admitted on a full,
    unreserved bucket and takes it below zero (the next requests wait until it refills)."""

    def __init__(self) -> None:
        self._requests: dict[str, _Bucket] = {}
        self._tokens: dict[str, _Bucket] = {}
        self._lock = threading.Lock()

    @staticmethod
    def _bucket(table: dict[str, _Bucket], name: str, per_min: int) -> _Bucket:
        b = table.get(name)
        if b is None or b.capacity != per_min:
            b = table[name] = _Bucket(capacity=float(per_min), level=float(per_min))
        return b

    def admit(self, p: Principal) -> float | None:
        """None when ``p`` may make a request now (and it is counted), else seconds to wait."""
        now = time.monotonic()
        with self._lock:
            if p.tokens_per_min is not None:
                tokens = self._bucket(self._tokens, p.name, p.tokens_per_min)
                tokens.refill(now)
                if tokens.level <= 0:
                    return tokens.wait_s(1.0)
            if p.requests_per_min is not None:
                requests = self._bucket(self._requests, p.name, p.requests_per_min)
                requests.refill(now)
                if requests.level < 1:
                    return requests.wait_s(1.0)
                requests.level -= 1
        return None

    def close(self) -> None:
        """Let go of what the quotas hold (nothing here)."""

    async def admit_async(self, p: Principal) -> float | None:
        """``admit`` from the event loop (it does no I/O here; SharedQuotas moves it to a thread)."""
        return self.admit(p)

    async def reserve_tokens_async(self, p: Principal, n: int, hold_id: str = "") -> float | None:
        """``reserve_tokens`` from the event loop."""
        return self.reserve_tokens(p, n, hold_id)

    def reserve_tokens(self, p: Principal, n: int, hold_id: str = "") -> float | None:
        """Take ``n`` tokens (an estimate: the prompt and the most the answer may use) from ``p``'s
        quota now, for the request ``hold_id``: None when they were taken, else the seconds until they
        (or the whole quota, for a request larger than it) are there. Nothing is taken for a key
        without ``tokens_per_min``."""
        if p.tokens_per_min is None or n <= 0:
            return None
        with self._lock:
            b = self._bucket(self._tokens, p.name, p.tokens_per_min)
            b.refill(time.monotonic())
            need = min(float(n), b.capacity)
            if b.level - b.held < need:
                return b.wait_s(need + b.held)  # a guess: running requests may give back much of what they hold
            b.held += n
        return None

    def settle_tokens(self, p: Principal, reserved: int, used: int, hold_id: str = "") -> None:
        """A request that reserved ``reserved`` tokens (as ``hold_id``) ended having used ``used``: its
        reservation is let go and what it used is charged."""
        if p.tokens_per_min is None:
            return
        with self._lock:
            b = self._bucket(self._tokens, p.name, p.tokens_per_min)
            b.refill(time.monotonic())
            b.held = max(0.0, b.held - reserved)
            b.level -= used


class SharedQuotas(Quotas):
    """The same quotas kept in the database (``buffer.quotas``), so that every replica on it counts
    against one bucket per key: a key allowed 600 requests a minute gets 600 in all, whichever replica
    serves them. Each admission and reservation is one short write transaction, run on this object's
    own threads (``*_async`` from the event loop); a settlement runs on a background thread. A key
    without quotas never touches the database.

    While the database does not answer, each replica falls back to its own buckets (the process
    ``Quotas``): a key then gets up to its quota per replica, rather than no service at all. After a
    failure the database is left alone for ``retry_s`` (every call would wait out its timeouts
    otherwise), and the fallback is logged once per outage. Holds taken so are settled in this process."""

    def __init__(self, engine, *, hold_s: float = 900.0, retry_s: float = 30.0) -> None:
        super().__init__()
        self._engine = engine
        self._hold_s = hold_s
        self._retry_s = retry_s
        self._local_until = 0.0  # monotonic: count in this process until then (the database failed)
        self._local_holds: set[str] = set()
        self._closed = False
        self._calls = concurrent.futures.ThreadPoolExecutor(max_workers=4, thread_name_prefix="quota")
        self._settler = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="quota-settle")

    async def admit_async(self, p: Principal) -> float | None:
        if p.tokens_per_min is None and p.requests_per_min is None:
            return None
        return await asyncio.get_running_loop().run_in_executor(self._calls, self.admit, p)

    async def reserve_tokens_async(self, p: Principal, n: int, hold_id: str = "") -> float | None:
        if p.tokens_per_min is None or n <= 0:
            return None
        return await asyncio.get_running_loop().run_in_executor(self._calls, self.reserve_tokens, p, n, hold_id)

    def _shared(self) -> bool:
        return time.monotonic() >= self._local_until

    def _fallback(self, what: str, exc: Exception) -> None:
        with self._lock:
            first = self._shared()
            self._local_until = time.monotonic() + self._retry_s
        if first:
            log.warning("quotas: the database did not answer (%s: %s); counting in this process for %.0f s",
                        what, type(exc).__name__, self._retry_s)

    def admit(self, p: Principal) -> float | None:
        if p.tokens_per_min is None and p.requests_per_min is None:
            return None
        if self._shared():
            try:
                return buffer.quotas.admit(engine=self._engine, name=p.name, requests_per_min=p.requests_per_min,
                                           tokens_per_min=p.tokens_per_min, now=time.time())
            except SQLAlchemyError as e:
                self._fallback("admit", e)
        return super().admit(p)

    def reserve_tokens(self, p: Principal, n: int, hold_id: str = "") -> float | None:
        if p.tokens_per_min is None or n <= 0:
            return None
        if not hold_id:
            raise ValueError("a shared token reservation needs the request's hold_id")
        if self._shared():
            try:
                return buffer.quotas.reserve(engine=self._engine, name=p.name, per_min=p.tokens_per_min, tokens=n,
                                             hold_id=hold_id, hold_s=self._hold_s, now=time.time())
            except SQLAlchemyError as e:
                self._fallback("reserve", e)
        wait = super().reserve_tokens(p, n, hold_id)
        if wait is None:
            with self._lock:
                self._local_holds.add(hold_id)
        return wait

    def settle_tokens(self, p: Principal, reserved: int, used: int, hold_id: str = "") -> None:
        if p.tokens_per_min is None:
            return
        with self._lock:
            local = hold_id in self._local_holds
            self._local_holds.discard(hold_id)
        if local:
            super().settle_tokens(p, reserved, used, hold_id)
        elif self._closed:  # shutting down: settle here rather than on a thread that is gone
            self._settle(p, used, hold_id)
        else:
            self._settler.submit(self._settle, p, used, hold_id)

    def _settle(self, p: Principal, used: int, hold_id: str) -> None:
        try:
            buffer.quotas.settle(engine=self._engine, name=p.name, per_min=p.tokens_per_min, hold_id=hold_id,
                                 used=used, now=time.time())
        except SQLAlchemyError as e:  # the hold lapses by itself; what it used goes uncharged
            log.warning("quotas: could not settle %s of key %r (%s)", hold_id, p.name, type(e).__name__)

    def drain(self, timeout: float = 10.0) -> None:
        """Wait for the settlements already handed to the background thread (tests, shutdown)."""
        self._settler.submit(lambda: None).result(timeout)

    def close(self) -> None:
        self._closed = True
        self._calls.shutdown(wait=True)
        self._settler.shutdown(wait=True)


def make_quotas(auth: AuthSection, db) -> Quotas:
    """The quotas ``auth.quotas`` asks for: counted in the database ``db``, or in this process."""
    return SharedQuotas(db, hold_s=auth.quota_hold_s) if auth.quotas == "database" else Quotas()


class Access:
    """The configured keys (plus the Explorer's own internal key for its release evaluations)."""

    def __init__(self, auth: AuthSection, *, internal_key: str, quotas: Quotas | None = None):
        self._keys: list[tuple[bytes, Principal]] = []
        for k in auth.keys:
            self._keys.append((bytes.fromhex(k.sha256), Principal(
                name=k.name, scopes=frozenset(k.scopes), agents=None if k.agents is None else frozenset(k.agents),
                train=k.train, requests_per_min=k.requests_per_min, tokens_per_min=k.tokens_per_min)))
        for i, plain in enumerate(auth.api_keys):
            self._keys.append((bytes.fromhex(key_digest(plain)), Principal(name=f"api_keys[{i}]", scopes=frozenset(SCOPES))))
        self.enabled = bool(self._keys)
        if self.enabled:
            self._keys.append((bytes.fromhex(key_digest(internal_key)),
                               Principal(name="release-gate", scopes=frozenset({"chat", "read"}))))
        self.anonymous = Principal(name=ANONYMOUS, scopes=frozenset(SCOPES))
        self.quotas = quotas if quotas is not None else Quotas()

    def authenticate(self, headers) -> Principal:
        """The caller of a request with ``headers``; APIError 401 without a valid key. Without
        configured keys everyone is the anonymous principal with every scope."""
        if not self.enabled:
            return self.anonymous
        token = presented_key(headers)
        if not token:
            raise APIError(401, "missing API key: send Authorization: Bearer <key> (or X-Api-Key: <key>)",
                           code="invalid_api_key")
        principal = self.identify(token)
        if principal is None:
            raise APIError(401, "incorrect API key", code="invalid_api_key")
        return principal

    def identify(self, token: str) -> Principal | None:
        """The key's holder, or None. Every digest is compared, each in constant time."""
        presented = hashlib.sha256(token.strip().encode()).digest()
        found = None
        for digest, principal in self._keys:
            if hmac.compare_digest(presented, digest) and found is None:
                found = principal
        return found


def check_agent(principal: Principal, agent: str | None, param: str = "model") -> None:
    """403 when ``principal``'s key may not use ``agent`` (None: an unknown model, left to the 404)."""
    if agent is not None and not principal.may_use(agent):
        raise APIError(403, f"API key {principal.name!r} may not use agent {agent!r}", param=param,
                       code="agent_not_allowed")


def audit_entry(principal: Principal, action: str, target: dict | None = None, **details) -> dict:
    """A row for the audit log: who (the key's name), what (action, target), details."""
    return {"actor": principal.name, "action": action, "target": target, "details": details}


def ids_target(ids: list[str]) -> dict:
    """The ids an action named, as the audit log keeps them (the first 20 and how many)."""
    return {"msg_ids": ids[:20], "count": len(ids)}
