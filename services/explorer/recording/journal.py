"""A local append-only journal of the records a chat answer promised, replayed at start.

The recorder writes to the database in batches, so a record lives in memory for a moment after its
chat is answered; if the database is slow or down, for much longer. To make "answered" mean
"recorded" even when the Explorer is then killed, every record is appended to a journal segment
file before the answer leaves (one ``write`` per request: it survives a kill -9 of the process at
once, and power loss after the recorder's next group fsync). A segment is deleted once every
record in it is in the database (or set aside as a dead letter). The open segment is sealed when it
reaches ``segment_bytes`` or when its first record is ``max_age_s`` old (``seal_if_old``), and at
once on ``rotate`` (a user's data deleted): the text of written records never waits on disk longer.

Several Explorers may share a journal directory: each holds an exclusive ``flock`` on its own open
segment, and an Explorer adopts every segment no live process holds (the leftovers of a crashed
one) at start and then every ``adopt_s`` while it runs (``adopt``): it replays their records, then
deletes them when written, so a replica that died for good leaves nothing unwritten behind. Replay is idempotent (the
recorder skips ids already in the buffer), so a segment deleted late is harmless.

    <dir>/segment-<time>-<pid>-<rand>.jsonl   one JSON record a line
    <dir>/dead-letters.jsonl                  records that no database would take, with the reason
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import secrets
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

from services.common.records import Experience

log = logging.getLogger(__name__)

DEAD_LETTERS = "dead-letters.jsonl"
_PREFIX = "segment-"


class JournalError(RuntimeError):
    """The journal directory cannot be used."""


@dataclass
class _Segment:
    path: Path
    fd: int  # open, flocked
    size: int = 0
    outstanding: int = 0  # records appended (or replayed) and not yet written to the database
    sealed: bool = False  # no more appends: delete once outstanding reaches 0
    dirty: bool = False  # appended to since the last fsync
    first_at: float | None = None  # monotonic time of its first append
    syncing: int = 0  # syncs using its descriptor now (outside the lock)
    gone: bool = False  # dropped or closed while a sync used it: the last sync closes the descriptor


def encode_record(record: Experience) -> bytes:
    """One JSON line. Any record fits: pydantic's fast encoder refuses lone surrogates, and then
    ASCII-escaped JSON keeps them losslessly."""
    try:
        return record.model_dump_json().encode() + b"\n"
    except ValueError:
        return json.dumps(record.model_dump(mode="json"), ensure_ascii=True, separators=(",", ":")).encode() + b"\n"


def append_dead_letter(path: Path, record: Experience, reason: str) -> Path:
    """Keep a record no database would take, with the reason, for a person to look at (and to
    re-insert by hand once mended: the line holds the whole record)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    line = json.dumps({"at": time.time(), "reason": reason, "experience": record.model_dump(mode="json")},
                      ensure_ascii=True, separators=(",", ":")).encode() + b"\n"
    while True:
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)  # a scrub (drop_dead_letters) replaces the file under this lock
            if os.fstat(fd).st_ino != _inode(path):
                continue  # replaced while this one waited: append to the new file
            os.write(fd, line)
            os.fsync(fd)
            return path
        finally:
            os.close(fd)


def _inode(path: Path) -> int | None:
    try:
        return os.stat(path).st_ino
    except FileNotFoundError:
        return None


def drop_dead_letters(path: Path, user_id: str, agents: Sequence[str] | None = None) -> int:
    """Rewrite the dead-letter file without ``user_id``'s records (of ``agents``, when given): a
    user's data deleted leaves none of their text here either. Returns how many lines went."""
    while True:
        try:
            fd = os.open(path, os.O_RDONLY)
        except FileNotFoundError:
            return 0
        fcntl.flock(fd, fcntl.LOCK_EX)  # appends wait; another replica's scrub too
        if os.fstat(fd).st_ino == _inode(path):
            break
        os.close(fd)  # replaced by another scrub meanwhile: lock the new one
    try:
        with open(path, "rb") as f:
            lines = f.readlines()
        keep = []
        for line in lines:
            try:
                exp = json.loads(line).get("experience") or {}
            except ValueError:
                keep.append(line)
                continue
            if exp.get("user_id") == user_id and (agents is None or exp.get("agent") in agents):
                continue
            keep.append(line)
        dropped = len(lines) - len(keep)
        if dropped:  # a new file renamed over the old one: a crash leaves one or the other, whole
            tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
            out = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            try:
                os.write(out, b"".join(keep))
                os.fsync(out)
            finally:
                os.close(out)
            os.replace(tmp, path)
            dir_fd = os.open(path.parent, os.O_RDONLY)
            try:
                os.fsync(dir_fd)
            finally:
                os.close(dir_fd)
        return dropped
    finally:
        os.close(fd)  # appenders waiting on the old file's lock see it replaced and reopen


@dataclass
class Replayed:
    records: list[Experience] = field(default_factory=list)
    segments: list[int] = field(default_factory=list)  # the segment key of each record
    torn: int = 0  # unreadable lines (a write cut by power loss; never an acknowledged record)


class Journal:
    def __init__(self, directory: str | Path, *, segment_bytes: int = 16 * 1024 * 1024):
        self.dir = Path(directory)
        self.segment_bytes = segment_bytes
        self._segments: dict[int, _Segment] = {}
        self._current: int | None = None
        self._next_key = 0
        self._closed = False
        # append/release run on the event loop, sync in a worker thread: the lock guards the
        # segment table, never a disk wait (sync fsyncs a duplicate of the fd, outside the lock).
        self._lock = threading.Lock()

    # ------------------------------------------------------------------ open / replay / close

    def open(self) -> Replayed:
        """Create the directory, adopt orphaned segments (returning their records), start a segment."""
        try:
            self.dir.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise JournalError(f"cannot create the journal directory {self.dir}: {e}") from e
        self._closed = False
        replayed = self._adopt()
        with self._lock:
            self._rotate()
        if replayed.records:
            log.warning("journal %s: %d records of an earlier run were not in the buffer yet; writing them now",
                        self.dir, len(replayed.records))
        return replayed

    def adopt(self) -> Replayed:
        """Adopt the segments no live process holds now (a replica sharing the directory that was
        killed, or stopped with records unwritten), as ``open`` does at start; their records are
        returned to be written, the segments go once they are."""
        replayed = self._adopt()
        if replayed.records:
            log.warning("journal %s: adopted %d records from segments no live process holds (a replica that died "
                        "or stopped); writing those not in the buffer yet", self.dir, len(replayed.records))
        return replayed

    def _adopt(self) -> Replayed:
        """Lock and read every orphaned segment. The directory is listed and the candidates opened and
        locked under the table's lock (no segment of this journal can appear meanwhile, so none of its
        own is ever opened a second time: on NFS, whose flock is a POSIX lock of the process, closing a
        second descriptor would drop the lock of the first); they are read through the locked
        descriptor, outside the table's lock."""
        replayed = Replayed()
        found: list[tuple[Path, int]] = []
        with self._lock:
            mine = {seg.path for seg in self._segments.values()}
            for path in sorted(self.dir.glob(f"{_PREFIX}*.jsonl")):
                if path in mine:
                    continue
                try:
                    fd = os.open(path, os.O_RDWR)
                except FileNotFoundError:
                    continue  # written and deleted by its owner since the listing
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    if os.fstat(fd).st_nlink == 0:  # its owner deleted it (all written) just before letting go
                        raise BlockingIOError
                except OSError:  # a live Explorer's segment (BlockingIOError), or one that cannot be locked
                    os.close(fd)
                    continue
                found.append((path, fd))
        for i, (path, fd) in enumerate(found):
            with self._lock:
                key = self._next_key
                self._next_key += 1
            first = len(replayed.records)
            try:
                n = self._read(path, fd, key, replayed)
            except OSError as e:  # let it go whole: another pass (or replica) adopts it
                log.error("journal %s: could not read %s (%s); leaving it for a later pass", self.dir, path.name, e)
                del replayed.records[first:], replayed.segments[first:]
                os.close(fd)
                continue
            with self._lock:
                if self._closed:  # closed meanwhile: the segments stay for the next Explorer to adopt
                    del replayed.records[first:], replayed.segments[first:]
                    for _, left in found[i:]:
                        os.close(left)
                    break
                self._segments[key] = _Segment(path=path, fd=fd, sealed=True, outstanding=n)
                if n == 0:
                    self._drop(key)
        return replayed

    def _read(self, path: Path, fd: int, key: int, out: Replayed) -> int:
        """The records of a segment, read through its locked descriptor."""
        chunks, offset = [], 0
        while chunk := os.pread(fd, 1 << 20, offset):
            chunks.append(chunk)
            offset += len(chunk)
        n = 0
        for line in b"".join(chunks).splitlines(keepends=True):
            try:
                record = Experience.model_validate(json.loads(line))
            except ValueError:
                out.torn += 1
                log.warning("journal %s: skipping an unreadable line (%d bytes)", path.name, len(line))
                continue
            out.records.append(record)
            out.segments.append(key)
            n += 1
        return n

    def close(self) -> None:
        """Release every segment; those with records not yet written stay for the next start."""
        with self._lock:
            self._closed = True
            self._close_all()

    def _close_all(self) -> None:
        for key in list(self._segments):
            seg = self._segments[key]
            if seg.outstanding == 0:
                self._drop(key)
            else:
                os.fsync(seg.fd)
                self._let_go(seg)
                del self._segments[key]
        self._current = None

    # ------------------------------------------------------------------ the hot path

    def append(self, records: Sequence[Experience]) -> int:
        """Append records in one write; returns the segment key to release them with later."""
        data = b"".join(encode_record(r) for r in records)
        with self._lock:
            key = self._current
            if key is None:
                raise JournalError("the journal is closed")
            seg = self._segments[key]
            os.write(seg.fd, data)
            if seg.first_at is None:
                seg.first_at = time.monotonic()
            seg.size += len(data)
            seg.outstanding += len(records)
            seg.dirty = True
            if seg.size >= self.segment_bytes:
                self._rotate()
        return key

    def sync(self) -> None:
        """Group commit: one fsync per segment covers every append since the last one. The fsync runs
        outside the lock on the segment's own descriptor (never a duplicate: closing one would drop an
        NFS lock); a segment dropped meanwhile is closed by the last sync using it."""
        with self._lock:
            segs = [seg for seg in self._segments.values() if seg.dirty]
            for seg in segs:
                seg.dirty = False
                seg.syncing += 1
        for seg in segs:
            try:
                os.fsync(seg.fd)
            finally:
                with self._lock:
                    seg.syncing -= 1
                    if seg.syncing == 0 and seg.gone:
                        os.close(seg.fd)

    def release(self, key: int, n: int = 1) -> None:
        """``n`` records of segment ``key`` are in the database; a sealed, empty segment goes."""
        with self._lock:
            seg = self._segments.get(key)
            if seg is None:
                return
            seg.outstanding -= n
            if seg.outstanding <= 0 and seg.sealed:
                self._drop(key)

    def rotate(self) -> bool:
        """Seal the open segment now if it holds anything (it goes as soon as its records are all
        written) and open a new one; True if it was sealed."""
        with self._lock:
            if self._current is None or self._segments[self._current].size == 0:
                return False
            self._rotate()
            return True

    def seal_if_old(self, max_age_s: float) -> bool:
        """``rotate`` when the open segment's first record is at least ``max_age_s`` old."""
        with self._lock:
            seg = None if self._current is None else self._segments[self._current]
            if seg is None or seg.first_at is None or time.monotonic() - seg.first_at < max_age_s:
                return False
            self._rotate()
            return True

    # ------------------------------------------------------------------ segments

    def _add(self, seg: _Segment) -> int:
        key = self._next_key
        self._next_key += 1
        self._segments[key] = seg
        return key

    def _rotate(self) -> None:
        if self._current is not None:
            old = self._segments[self._current]
            old.sealed = True
            if old.outstanding <= 0:
                self._drop(self._current)
        # Created under a temporary name and locked before it gets its real name, so another
        # Explorer scanning the directory never mistakes a new segment for an orphan.
        name = f"{_PREFIX}{time.time_ns():020d}-{os.getpid()}-{secrets.token_hex(4)}.jsonl"
        tmp = self.dir / f".new-{name}"
        fd = os.open(tmp, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_EXCL, 0o600)
        fcntl.flock(fd, fcntl.LOCK_EX)
        os.rename(tmp, self.dir / name)
        self._current = self._add(_Segment(path=self.dir / name, fd=fd))

    def _drop(self, key: int) -> None:
        seg = self._segments.pop(key)
        seg.path.unlink(missing_ok=True)  # unlink before close: nobody can adopt it in between
        self._let_go(seg)
        if key == self._current:
            self._current = None

    @staticmethod
    def _let_go(seg: _Segment) -> None:
        """Close the segment's descriptor, now or (while a sync uses it) when that sync ends."""
        if seg.syncing:
            seg.gone = True
        else:
            os.close(seg.fd)

    @property
    def segment_count(self) -> int:
        return len(self._segments)
