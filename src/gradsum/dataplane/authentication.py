"""Authenticated control messages: HMAC-SHA256 trailers, a replay window, wrapped job keys.

A signed control message (header flag ``SIGNED``) ends in a 56-byte trailer::

    u64 timestamp (ms since the Unix epoch), 16-byte nonce, 32-byte HMAC-SHA256 tag

The tag covers the aggregator's port and every byte before it (header, body, timestamp,
nonce) under the key the message claims: an admission secret (REGISTER, aggregator-wide STATS)
or the job's own key (TEARDOWN, a job's STATS). The aggregator accepts a timestamp within
``WINDOW_S`` of its clock and each nonce once within that window, remembered per principal
(``ReplayGuard``), so a recorded message cannot be replayed and no principal's flood of signed
requests locks out another; a retry is a new message. A reply to a signed request is signed
with the same key, so a worker can tell it from a spoof.

A job's key travels to the aggregator in its REGISTER body, masked with a keystream only the
admission secret's holders can compute (``wrap_key``): an observer of the network who lacks the
secret learns neither the key nor, so, the job's data token (``data_token``).
"""

from __future__ import annotations

import hashlib
import heapq
import hmac
import os
import struct

TRAILER = struct.Struct("<Q16s32s")
TRAILER_SIZE = TRAILER.size  # 56
KEY_SIZE = 32
WINDOW_S = 30.0  # accepted clock difference between a signer and the aggregator
MAX_NONCES = 1 << 16  # remembered within the window, over all principals (ReplayGuard)


def sign(message: bytes, key: bytes, wall: float, port: int = 0) -> bytes:
    """``message`` (its header's SIGNED flag set) with a fresh trailer under ``key``. ``port``:
    the aggregator's UDP port, bound into the tag but not sent, so a message recorded on its
    way to one pipeline (``--pipelines``: one port and one replay window each) fails at
    another."""
    stamp = struct.pack("<Q16s", int(wall * 1000), os.urandom(16))
    return message + stamp + _tag(key, port.to_bytes(2, "little") + message + stamp)


def split(data: bytes) -> tuple[bytes, int, bytes, bytes] | None:
    """(message, timestamp ms, nonce, tag) of a signed datagram; None if it is too short."""
    if len(data) < TRAILER_SIZE:
        return None
    message = data[:-TRAILER_SIZE]
    timestamp, nonce, tag = TRAILER.unpack_from(data, len(message))
    return message, timestamp, nonce, tag


def verifies(data: bytes, key: bytes, port: int = 0) -> bool:
    """Whether the signed datagram ``data`` carries a valid tag under ``key`` (for the
    aggregator at ``port``, as ``sign``)."""
    if len(data) < TRAILER_SIZE:
        return False
    signed, tag = data[:-32], data[-32:]
    return hmac.compare_digest(_tag(key, port.to_bytes(2, "little") + signed), tag)


def _tag(key: bytes, data: bytes) -> bytes:
    return hmac.new(key, data, hashlib.sha256).digest()


class ReplayGuard:
    """Timestamps within the window, each nonce once: what makes a replayed message fail.

    Nonces are remembered per principal (the key that signed them: an admission secret or a
    job's key) until their timestamp leaves the window, ``capacity`` of them in all. When the
    memory is full, room is made at the expense of the principal that holds the most (at
    least its fair share): its oldest-stamped nonce is forgotten and its *floor* rises to that
    timestamp, so a message of that principal signed at or before the floor is refused from
    then on (a replay of a forgotten nonce among them). Nothing is ever refused for load: one
    principal that signs a flood only moves its own floor, and every other principal's fresh
    messages pass.
    """

    def __init__(self, window: float = WINDOW_S, capacity: int = MAX_NONCES):
        self.window, self.capacity = window, capacity
        self._windows: dict[bytes, _Window] = {}  # principal (its key) -> its nonces
        self._held = 0  # nonces remembered, over every principal
        self.forgotten = 0  # nonces forgotten early to make room (their principals' floors rose)

    def check(self, timestamp_ms: int, nonce: bytes, wall: float,
              principal: bytes = b"") -> str | None:  # fmt: skip
        """None, and the nonce remembered, for a fresh message of ``principal``; else why it
        is refused (every reason a replay or a clock's fault, never load)."""
        stamp = timestamp_ms / 1000
        if abs(stamp - wall) > self.window:
            off = stamp - wall
            return f"timestamp {off:+.1f} s off the aggregator's clock (window {self.window:g} s)"
        own = self._windows.get(principal)
        if own is None:
            own = self._windows[principal] = _Window()
        self._held -= own.expire(wall - self.window)
        if nonce in own.seen:
            return "a replayed nonce"
        if stamp <= own.floor:
            return (f"signed {own.floor - stamp:.3f} s before the oldest request of this key "
                    "still remembered (its nonces are forgotten after a flood of its own "
                    "signed requests, which may be replayed ones); sign it again")  # fmt: skip
        if self._held >= self.capacity:
            self._make_room(own, wall)
        own.add(stamp, nonce)
        self._held += 1
        return None

    def held(self, principal: bytes) -> int:
        """Nonces remembered for ``principal``."""
        own = self._windows.get(principal)
        return 0 if own is None else len(own.seen)

    def _make_room(self, own: _Window, wall: float) -> None:
        """Forget one nonce: ``own``'s oldest when it holds at least its fair share (a flood's
        own cost, in constant time); else expired ones, else the oldest of the principal
        holding the most."""
        if len(own.seen) * len(self._windows) < self.capacity:  # below its share
            for key in list(self._windows):
                window = self._windows[key]
                self._held -= window.expire(wall - self.window)
                if not window.seen and window.floor < wall - self.window and window is not own:
                    del self._windows[key]  # its floor refuses nothing the clock check lets in
            if self._held < self.capacity:
                return
            own = max(self._windows.values(), key=lambda window: len(window.seen))
        own.forget_oldest()
        self._held -= 1
        self.forgotten += 1


class _Window:
    """One principal's remembered nonces, by timestamp, and its floor."""

    __slots__ = ("floor", "seen", "stamps")

    def __init__(self):
        self.seen: set[bytes] = set()
        self.stamps: list[tuple[float, bytes]] = []  # a heap: the oldest stamp first
        self.floor = float("-inf")  # refused at or before: its forgotten nonces' latest stamp

    def add(self, stamp: float, nonce: bytes) -> None:
        self.seen.add(nonce)
        heapq.heappush(self.stamps, (stamp, nonce))

    def expire(self, before: float) -> int:
        """Forget the nonces stamped before ``before`` (the clock check refuses them now);
        how many."""
        gone = 0
        while self.stamps and self.stamps[0][0] < before:
            self.seen.discard(heapq.heappop(self.stamps)[1])
            gone += 1
        return gone

    def forget_oldest(self) -> None:
        stamp, nonce = heapq.heappop(self.stamps)
        self.seen.discard(nonce)
        self.floor = max(self.floor, stamp)


def wrap_key(job_key: bytes, secret: bytes, nonce: bytes) -> bytes:
    """The job key masked with HMAC(secret, nonce): the same call unwraps it."""
    stream = hmac.new(secret, b"gradsum job key\0" + nonce, hashlib.sha256).digest()
    return bytes(a ^ b for a, b in zip(job_key, stream, strict=True))


def data_token(job_key: bytes) -> int:
    """The job's 64-bit data token (never 0: 0 marks a job without one), from its key."""
    digest = hmac.new(job_key, b"gradsum data token", hashlib.sha256).digest()
    return int.from_bytes(digest[:8], "little") or 1


TAG_SIZE = 16  # bytes of a data packet's MAC (integrity "mac")


def packet_mac_key(job_key: bytes) -> bytes:
    """The key of the job's per-packet MACs, from its key (never the key itself)."""
    return hmac.new(job_key, b"gradsum data mac", hashlib.sha256).digest()


def packet_tag(mac_key: bytes, *parts) -> bytes:
    """A data packet's MAC: keyed BLAKE2b-128 of its header and payload (the stdlib's fastest
    keyed hash; HMAC-SHA256 costs about three times as much per byte)."""
    digest = hashlib.blake2b(key=mac_key, digest_size=TAG_SIZE)
    for part in parts:
        digest.update(part)
    return digest.digest()


def new_key() -> bytes:
    return os.urandom(KEY_SIZE)


def load_secrets(path: str | None = None, environ: dict | None = None) -> dict[str, bytes]:
    """Admission secrets by name. From ``path`` (lines ``NAME SECRET``, or one ``SECRET`` per
    line named by its line; ``#`` comments), else ``GRADSUM_ADMISSION_FILE``, else the one
    secret in ``GRADSUM_ADMISSION_SECRET`` (named ``default``); {} without any. Never a flag:
    the secret would show in ``ps``."""
    environ = os.environ if environ is None else environ
    for name in ("GRADSUM_ADMISSION_FILE", "GRADSUM_ADMISSION_SECRET"):
        # set but empty: most likely `export X=$(cat FILE)` of a file that is not there; running
        # open then would let anyone register, so it is an error, not a warning
        if name in environ and not environ[name].strip():
            raise ValueError(
                f"{name} is set but empty; make a secret with `python -c \"import secrets; "
                f"print(secrets.token_urlsafe(32))\"`, or unset {name} to run without one"
            )
    path = path or environ.get("GRADSUM_ADMISSION_FILE")
    if path:
        secrets: dict[str, bytes] = {}
        with open(path) as handle:
            for number, line in enumerate(handle, 1):
                words = line.split("#", 1)[0].split()
                if not words:
                    continue
                if len(words) > 2:
                    raise ValueError(f"{path}:{number}: expected NAME SECRET or SECRET")
                name, secret = words if len(words) == 2 else (f"secret{number}", words[0])
                if len(secret) < 16:
                    raise ValueError(f"{path}:{number}: a secret needs at least 16 characters")
                secrets[name] = secret.encode()
        if not secrets:
            raise ValueError(f"{path}: no admission secret in it")
        return secrets
    secret = environ.get("GRADSUM_ADMISSION_SECRET")
    if secret:
        if len(secret) < 16:
            raise ValueError(
                f"GRADSUM_ADMISSION_SECRET needs at least 16 characters, it has {len(secret)}"
            )
        return {"default": secret.encode()}
    return {}
