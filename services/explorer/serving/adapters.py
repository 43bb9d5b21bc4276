"""Which adapter version serves each agent, and when old versions may be let go.

Every request leases the handle of its agent's current version for its whole life, so the
version that produced each token is known and cannot be unloaded under it. A newly published
version is loaded into the engine first and then made current; new requests get it at once,
running ones finish on the old one, which is removed from the engine when its last lease ends.

Model names a request may use: ``<agent>`` (current version), ``<agent>@v<N>`` (a pinned version,
``@v0`` being the base model under that agent's name), and the base model's served name or path,
which Trinity-style clients send: it means the default agent's current version. Each replica also writes ``<root>/<agent>/.serving/<replica>.json``
with the versions it may still read, so the Trainer never deletes a folder an engine needs.

LATEST names the version that serves, and it may move back (a rollback): whatever it names is
loaded. During a canary (release.mode canary) an agent also holds its candidate, which serves the
calls whose task_id routes to it (services/common/release.py); promoting it makes it current with no
second load.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import os
import random
import re
import socket
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterator

from services.common import checkpoints
from services.common.checkpoints import CheckpointError
from services.common.release import routed_to_candidate
from services.explorer.serving.engines.base import AdapterRef, Engine

log = logging.getLogger(__name__)

_PINNED = re.compile(r"^(?P<agent>[A-Za-z0-9][A-Za-z0-9._-]{0,127})@v(?P<version>\d+)$")


class UnknownModel(LookupError):
    pass


@dataclass
class AdapterHandle:
    agent: str
    version: int
    ref: AdapterRef | None  # None: the base model
    leases: int = 0
    retired: bool = False
    loaded_at: float = field(default_factory=time.time)


@dataclass
class AgentState:
    name: str
    current: AdapterHandle
    failed_version: int | None = None  # a broken LATEST we already refused
    reloads: int = 0
    last_reload_s: float | None = None
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    canary: AdapterHandle | None = None  # a candidate serving a share of the traffic
    canary_share: float = 0.0
    routed: dict[str, int] = field(default_factory=lambda: {"serving": 0, "candidate": 0})  # calls since the canary began


class AdapterRegistry:
    def __init__(
        self,
        *,
        engine: Engine,
        checkpoints_root: str,
        base_name: str,
        agents: list[str],
        base_aliases: tuple[str, ...] = (),
        default_agent: str,
        replica_id: str | None = None,
        on_reload: Callable[[str, int, float], None] | None = None,
        held_versions: Callable[[str], set[int]] | None = None,
    ):
        self._engine = engine
        self.root = checkpoints_root
        self.base_name = base_name
        # Trinity-style clients name the base model; they get the default agent's current version.
        self.base_aliases = {base_name, *base_aliases}
        self.default_agent = default_agent
        self._configured = list(dict.fromkeys([default_agent, *agents]))
        self.agents: dict[str, AgentState] = {}
        self._pinned: dict[tuple[str, int], AdapterHandle] = {}
        self._ids = itertools.count(1)
        self._used_names: set[str] = set()
        self._loaded: dict[str, AdapterHandle] = {}  # by adapter name: every load not yet removed
        self._pending_removals: set[asyncio.Task] = set()
        self.replica_id = replica_id or f"{socket.gethostname()}-{os.getpid()}"
        self._on_reload = on_reload
        self.reload_failures = 0
        # Versions not loaded now that something may still ask for (episode pins): kept on disk.
        self.held_versions: Callable[[str], set[int]] = held_versions or (lambda agent: set())

    # ------------------------------------------------------------------ loading

    def _new_ref(self, agent: str, version: int, path: Path) -> AdapterRef:
        """A name and id never used before in this process, also when a version is loaded again
        (pinned after it was released): an engine may still be removing the previous load under
        the old name, and vLLM serves stale weights for a reused name or id."""
        n = next(self._ids)
        name = f"{agent}-v{version}"
        if name in self._used_names:
            name = f"{name}-load{n}"
        self._used_names.add(name)
        return AdapterRef(agent=agent, version=version, name=name, int_id=n, path=str(path))

    async def start(self) -> None:
        """Load the newest version of every configured or discovered agent."""
        names = list(dict.fromkeys([*self._configured, *checkpoints.list_agents(self.root)]))
        for name in names:
            self.agents[name] = AgentState(name=name, current=AdapterHandle(agent=name, version=0, ref=None))
            await self.sync(name)
        self.write_serving_files()

    async def sync(self, agent: str) -> bool:
        """Load the version LATEST names if it is not the current one (newer, or older after a
        rollback). True if it changed."""
        state = self.agents[agent]
        async with state.lock:
            try:
                latest = checkpoints.read_latest(self.root, agent)
            except CheckpointError as e:
                self._refuse(state, None, str(e))
                return False
            if latest is None or latest == state.current.version or latest == state.failed_version:
                return False
            t0 = time.perf_counter()
            if state.canary is not None and state.canary.version == latest:  # the candidate is promoted: no second load
                handle, state.canary = state.canary, None
                handle.retired = False
            elif latest == 0:
                handle = _base_handle(agent)
            else:
                try:
                    version = checkpoints.validate_version(self.root, agent, latest)
                    ref = self._new_ref(agent, latest, version.path)
                    await self._engine.add_adapter(ref)
                except Exception as e:  # a broken version never replaces a working one
                    self._refuse(state, latest, str(e))
                    return False
                handle = AdapterHandle(agent=agent, version=latest, ref=ref)
                self._loaded[ref.name] = handle
            old = state.current
            state.current = handle
            state.failed_version = None
            elapsed = time.perf_counter() - t0
            state.reloads += 1
            state.last_reload_s = elapsed
            log.info("agent %s: now serving v%d (was v%d), loaded in %.0f ms", agent, latest, old.version, elapsed * 1e3)
            self._retire(old)
            self.write_serving_files()
            if self._on_reload:
                self._on_reload(agent, latest, elapsed)
            return True

    async def set_canary(self, agent: str, version: int, share: float) -> None:
        """Serve ``version`` to ``share`` of ``agent``'s traffic (by task_id) beside the current one."""
        state = self.agents[agent]
        async with state.lock:
            if state.canary is not None and state.canary.version == version:
                state.canary_share = share
                return
            v = checkpoints.validate_version(self.root, agent, version)
            ref = self._new_ref(agent, version, v.path)
            await self._engine.add_adapter(ref)
            if state.canary is not None:
                self._retire(state.canary)
            state.canary = AdapterHandle(agent=agent, version=version, ref=ref)
            state.canary_share = share
            state.routed = {"serving": 0, "candidate": 0}
            self._loaded[ref.name] = state.canary
            log.info("agent %s: canary of v%d on %.0f%% of the traffic (v%d serves the rest)", agent, version, share * 100,
                     state.current.version)
        self.write_serving_files()

    def clear_canary(self, agent: str) -> None:
        """End the canary: new calls all go to the current version; running ones finish on theirs."""
        state = self.agents[agent]
        if state.canary is not None:
            handle, state.canary = state.canary, None
            self._retire(handle)
            log.info("agent %s: canary of v%d ended", agent, handle.version)

    def _refuse(self, state: AgentState, version: int | None, why: str) -> None:
        if version is not None and version == state.failed_version:
            return
        state.failed_version = version
        self.reload_failures += 1
        log.error("agent %s: refusing version %s, still serving v%d: %s", state.name, version, state.current.version, why)

    async def watch(self, interval_s: float, *, discover_every_s: float = 5.0, heartbeat_s: float = 10.0) -> None:
        """Poll every agent's LATEST forever (cancel the task to stop).

        Reading one small file per agent is cheap, so the poll can be frequent; scanning the root
        for new agents and refreshing the serving files (the Trainer's view of what is in use)
        happen less often.
        """
        last_discovery = last_heartbeat = time.monotonic()
        while True:
            await asyncio.sleep(interval_s)
            try:
                now = time.monotonic()
                if now - last_discovery >= discover_every_s:
                    self._discover()
                    last_discovery = now
                for name in list(self.agents):
                    await self.sync(name)
                if now - last_heartbeat >= heartbeat_s:
                    self.write_serving_files()
                    last_heartbeat = now
            except Exception:
                log.exception("adapter watch failed; will retry")

    def _discover(self) -> None:
        for name in checkpoints.list_agents(self.root):
            if name not in self.agents:
                self.agents[name] = AgentState(name=name, current=_base_handle(name))
                log.info("discovered agent %s under %s", name, self.root)

    # ------------------------------------------------------------------ leases

    def agent_of(self, model: str) -> str | None:
        """The agent a model name serves at its current version (None: a pinned or unknown name)."""
        if model in self.base_aliases:
            return self.default_agent
        return model if model in self.agents else None

    def agent_named(self, model: str) -> str | None:
        """The agent a model name belongs to, pinned names (``agent@vN``) included; None: unknown."""
        if (agent := self.agent_of(model)) is not None:
            return agent
        m = _PINNED.match(model)
        return m["agent"] if m else None

    def resolve(self, model: str, route_key: str | None = None) -> tuple[str, AdapterHandle | None, int | None]:
        """(agent, handle or None if a pinned version must be loaded first, pinned version).
        ``route_key`` (the call's task_id) decides whether a canary's candidate serves it."""
        if model in self.base_aliases:
            model = self.default_agent
        if model in self.agents:
            state = self.agents[model]
            if state.canary is not None:
                to_candidate = random.random() < state.canary_share if route_key is None \
                    else routed_to_candidate(model, route_key, state.canary_share)
                state.routed["candidate" if to_candidate else "serving"] += 1
                if to_candidate:
                    return model, state.canary, None
            return model, state.current, None
        m = _PINNED.match(model)
        if m and m.group("agent") in self.agents:
            agent, version = m.group("agent"), int(m.group("version"))
            state = self.agents[agent]
            if version == 0:
                return agent, _base_handle(agent), 0
            if state.current.version == version:
                return agent, state.current, version
            if state.canary is not None and state.canary.version == version:
                return agent, state.canary, version
            handle = self._pinned.get((agent, version)) or self._leased(agent, version)
            return agent, handle, version
        raise UnknownModel(model)

    async def acquire(self, model: str, route_key: str | None = None) -> AdapterHandle:
        agent, handle, pinned = self.resolve(model, route_key)
        if handle is None:
            handle = await self._load_pinned(agent, pinned)
        handle.leases += 1
        return handle

    def _leased(self, agent: str, version: int) -> AdapterHandle | None:
        """A retired load of this version that requests still hold. Safe to share: a handle is only
        removed once its leases reach zero, and sharing needs them above zero."""
        for h in self._loaded.values():
            if h.agent == agent and h.version == version and h.leases > 0 and h.ref is not None:
                return h
        return None

    async def _load_pinned(self, agent: str, version: int) -> AdapterHandle:
        state = self.agents[agent]
        async with state.lock:
            handle = self._pinned.get((agent, version)) or self._leased(agent, version)
            if handle is not None:
                return handle
            try:
                v = checkpoints.validate_version(self.root, agent, version)
            except CheckpointError as e:
                log.info("pinned %s@v%d is not servable: %s", agent, version, e)  # paths stay in the log
                raise UnknownModel(f"{agent}@v{version}") from None
            ref = self._new_ref(agent, version, v.path)
            await self._engine.add_adapter(ref)
            handle = AdapterHandle(agent=agent, version=version, ref=ref, retired=True)
            self._pinned[(agent, version)] = handle
            self._loaded[ref.name] = handle
            self.write_serving_files()
            return handle

    def release(self, handle: AdapterHandle) -> None:
        handle.leases -= 1
        if handle.leases <= 0 and handle.retired:
            self._schedule_removal(handle)

    def _retire(self, handle: AdapterHandle) -> None:
        handle.retired = True
        if handle.leases <= 0:
            self._schedule_removal(handle)

    def _schedule_removal(self, handle: AdapterHandle) -> None:
        if handle.ref is None:
            return
        self._pinned.pop((handle.agent, handle.version), None)
        task = asyncio.ensure_future(self._remove(handle))
        self._pending_removals.add(task)
        task.add_done_callback(self._pending_removals.discard)

    async def _remove(self, handle: AdapterHandle, attempts: int = 5) -> None:
        for attempt in range(attempts):
            if handle.leases > 0 or handle.ref is None:
                return  # leased again (its last release will schedule the removal) or already gone
            try:
                await self._engine.remove_adapter(handle.ref)
            except Exception as e:  # e.g. the engine has not pruned a just-finished request yet
                if attempt + 1 == attempts:
                    log.error("removing adapter %s failed %d times, leaving it loaded: %s", handle.ref.name, attempts, e)
                    return
                await asyncio.sleep(0.2 * 2**attempt)
                continue
            log.info("agent %s: released v%d", handle.agent, handle.version)
            self._loaded.pop(handle.ref.name, None)
            handle.ref = None
            self.write_serving_files()
            return

    # ------------------------------------------------------------------ reporting

    def in_use(self, agent: str) -> list[int]:
        """Versions of ``agent`` this replica may still read from disk: every load not yet removed
        from the engine (the current version, pinned ones, retired ones still leased or being removed)
        and the versions of episodes still under way."""
        loaded = {h.version for h in self._loaded.values() if h.agent == agent}
        return sorted(loaded | {v for v in self.held_versions(agent) if v > 0})

    def write_serving_files(self) -> None:
        """Tell the Trainer which versions this replica still needs (refreshed by watch())."""
        for agent in self.agents:
            try:
                checkpoints.write_serving(self.root, agent, replica=self.replica_id, versions=self.in_use(agent))
            except OSError as e:
                log.warning("cannot write serving file for %s: %s", agent, e)

    def remove_serving_files(self) -> None:
        for agent in self.agents:
            with contextlib.suppress(OSError):
                checkpoints.remove_serving(self.root, agent, replica=self.replica_id)

    def describe(self) -> Iterator[dict]:
        for name, state in sorted(self.agents.items()):
            yield {
                "agent": name,
                "version": state.current.version,
                "adapter": state.current.ref.name if state.current.ref else None,
                "reloads": state.reloads,
                "last_reload_s": state.last_reload_s,
                "loaded_at": state.current.loaded_at,
                "canary": None if state.canary is None else {
                    "version": state.canary.version, "share": state.canary_share, "routed": dict(state.routed)},
            }


def _base_handle(agent: str) -> AdapterHandle:
    """A fresh handle for the base model (nothing to load or release)."""
    return AdapterHandle(agent=agent, version=0, ref=None)
