"""A TCP gate between S3 clients and the moto server, and a moto server that restarts with its state.

Real stores fail in ways a healthy moto never does: connections refused or cut, 503 SlowDown, a
reply lost after the request was applied, the server restarting. The gate passes bytes through
untouched and, on demand, produces exactly those failures at the socket level, so the code under
test sees what a client of a real store sees. Two answers moto never gives are made from the HTTP
request itself: AWS's 409 ConditionalRequestConflict to a conditional create (`If-None-Match: *`)
racing another, and a store that ignores the condition and overwrites.

A restart is made fair (a real S3 outage loses no objects) with moto's request recorder: every
request the server handles is appended to a journal; a fresh server process replays the journal's
writes before the gate lets clients through again. The gate is down during the restart, so no
client ever sees the half-restored server.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
import urllib.request
from pathlib import Path

from helpers.polling import wait_for

_BUSY_BODY = b"<Error><Code>SlowDown</Code><Message>Please reduce your request rate.</Message></Error>"
BUSY_REPLY = (
    b"HTTP/1.1 503 Slow Down\r\nContent-Type: application/xml\r\nConnection: close\r\n"
    b"Content-Length: %d\r\n\r\n%s" % (len(_BUSY_BODY), _BUSY_BODY)
)
# What AWS S3 answers a conditional create that races another for the same key (its documented body).
_CONFLICT_BODY = (
    b'<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>ConditionalRequestConflict</Code><Message>'
    b"A conflicting operation occurred. If using PutObject you can retry the request. If using multipart "
    b"upload you should initiate another CreateMultipartUpload request and re-upload each part.</Message>"
    b"<RequestId>VTGATE409</RequestId></Error>"
)
CONFLICT_REPLY = (
    b"HTTP/1.1 409 Conflict\r\nContent-Type: application/xml\r\nConnection: close\r\n"
    b"Content-Length: %d\r\n\r\n%s" % (len(_CONFLICT_BODY), _CONFLICT_BODY)
)


class Gate:
    """127.0.0.1:<port> -> moto. Modes: open (pass), down (accept and close at once: the service is gone).

    `busy = n`: the next n connections get a 503 SlowDown and are closed. `lose_replies = n`: the next
    n connections reach the server, but its reply is dropped and the connection cut.

    Read as HTTP, one request a connection (told `Connection: close`) while either is set: `conflicts = n`:
    the next n conditional creates of a key holding `conflict_keys` get AWS's 409 ConditionalRequestConflict
    (counted in `conflicted`), as racing creates do on AWS; `ignore_conditions`: `If-None-Match` is taken
    off every conditional create (counted in `unconditioned`), so the server overwrites as a store without
    conditional writes does.
    """

    def __init__(self, upstream: int):
        self.upstream = upstream
        self.mode = "open"
        self.busy = 0
        self.lose_replies = 0
        self.conflicts = 0
        self.conflict_keys = ""
        self.ignore_conditions = False
        self.refused = self.answered_busy = self.replies_lost = self.conflicted = self.unconditioned = 0
        self._lock = threading.Lock()
        self._sockets: set[socket.socket] = set()
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port = self._listener.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(client,), daemon=True).start()

    def _serve(self, client: socket.socket) -> None:
        with self._lock:
            mode = self.mode
            busy = self.busy > 0 and mode == "open"
            lose = not busy and self.lose_replies > 0 and mode == "open"
            read_http = not (busy or lose) and mode == "open" and (self.conflicts > 0 or self.ignore_conditions)
            self.busy -= busy
            self.lose_replies -= lose
            self.refused += mode == "down"
        if mode == "down":
            client.close()
            return
        if busy:
            head = _read_head(client)
            client.sendall(
                BUSY_REPLY if not head.startswith(b"HEAD ") else BUSY_REPLY.split(b"\r\n\r\n")[0] + b"\r\n\r\n"
            )
            client.close()
            with self._lock:
                self.answered_busy += 1
            return
        request = self._request(client) if read_http else b""
        if request is None:
            return
        try:
            upstream = socket.create_connection(("127.0.0.1", self.upstream))
        except OSError:
            client.close()
            return
        with self._lock:
            self._sockets.update((client, upstream))
        if request:
            upstream.sendall(request)
        else:
            threading.Thread(target=self._pipe, args=(client, upstream, False), daemon=True).start()
        self._pipe(upstream, client, lose)

    def _request(self, client: socket.socket) -> bytes | None:
        """The client's request as it goes on to the server (told to close after its reply), or None when the
        gate answered it itself (409) or the client sent nothing."""
        try:
            head, _, body = _read_head(client).partition(b"\r\n\r\n")
            start, *lines = head.split(b"\r\n")
            fields = {line.split(b":", 1)[0].strip().lower(): line.split(b":", 1)[1].strip() for line in lines}
            assert b"transfer-encoding" not in fields, "the gate reads bodies by Content-Length only"
            if fields.get(b"expect", b"").lower() == b"100-continue":
                client.sendall(b"HTTP/1.1 100 Continue\r\n\r\n")
            while head and len(body) < int(fields.get(b"content-length", b"0")):
                chunk = client.recv(65536)
                if not chunk:
                    break
                body += chunk
        except OSError:  # the client went away (a down() cut it, or it gave up)
            head = b""
        if not head:
            _close(client)
            return None
        method, target = start.split(b" ")[:2]
        conditional = method == b"PUT" and fields.get(b"if-none-match") == b"*"
        with self._lock:
            conflict = conditional and self.conflicts > 0 and self.conflict_keys.encode() in target
            strip = conditional and self.ignore_conditions and not conflict
            self.conflicts -= conflict
            self.conflicted += conflict
            self.unconditioned += strip
        if conflict:
            client.sendall(CONFLICT_REPLY)
            _close(client)
            return None
        dropped = (b"connection", b"expect", *((b"if-none-match",) if strip else ()))
        kept = [line for line in lines if line.split(b":", 1)[0].strip().lower() not in dropped]
        return b"\r\n".join([start, *kept, b"Connection: close"]) + b"\r\n\r\n" + body

    def _pipe(self, source: socket.socket, sink: socket.socket, lose: bool) -> None:
        try:
            while chunk := source.recv(65536):
                if lose:  # the server answered: the request was applied; its reply never arrives
                    with self._lock:
                        self.replies_lost += 1
                    break
                sink.sendall(chunk)
        except OSError:
            pass
        for sock in (source, sink):
            _close(sock)
            with self._lock:
                self._sockets.discard(sock)

    def down(self) -> None:
        """Refuse new connections and cut the open ones (requests in flight may or may not have landed)."""
        with self._lock:
            self.mode = "down"
            sockets = list(self._sockets)
        for sock in sockets:
            _close(sock)

    def open(self, upstream: int | None = None) -> None:
        with self._lock:
            self.upstream = upstream or self.upstream
            self.mode = "open"

    def close(self) -> None:
        self.down()
        self._listener.close()


def _read_head(sock: socket.socket) -> bytes:
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65536)
        if not chunk:
            break
        data += chunk
    return data


def _close(sock: socket.socket) -> None:
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass
    sock.close()


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def journal_entries(text: str) -> list[dict]:
    """The records of moto's journal, read as a stream of JSON objects: moto writes a record and its newline
    in two calls, so a record over its 8 KiB file buffer and another thread's record can share a line. A
    last record cut short (being written, or the server killed while writing it) is left out."""
    decoder, entries, at = json.JSONDecoder(), [], 0
    while True:
        while at < len(text) and text[at].isspace():
            at += 1
        if at == len(text):
            return entries
        try:
            entry, at = decoder.raw_decode(text, at)
        except json.JSONDecodeError:
            if "\n{" in text[at:]:  # a whole record follows: this one is damaged, not cut short
                raise
            return entries
        entries.append(entry)


class RecordedMoto:
    """A moto_server process that journals every request, so a new process can take over its state."""

    def __init__(self, journal: Path):
        self.journal = journal
        self.proc: subprocess.Popen | None = None
        self.port = 0
        self.start()

    def start(self) -> None:
        self.port = _free_port()
        env = {**os.environ, "MOTO_ENABLE_RECORDING": "True", "MOTO_RECORDER_FILEPATH": str(self.journal)}
        moto = Path(sys.executable).with_name("moto_server")
        self.proc = subprocess.Popen(
            [str(moto), "-H", "127.0.0.1", "-p", str(self.port)],
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )

        def listening():
            with socket.socket() as sock:
                return sock.connect_ex(("127.0.0.1", self.port)) == 0

        wait_for(listening, timeout=30, what="moto_server to listen")

    def requests(self) -> int:
        """Requests the server has handled so far (journal lines)."""
        return len(journal_entries(self.journal.read_text())) if self.journal.exists() else 0

    def crash_and_restart(self) -> None:
        """SIGKILL the server, start a new one and replay the journal's writes into it."""
        self.proc.kill()
        self.proc.wait(timeout=10)
        writes = [
            entry for entry in journal_entries(self.journal.read_text()) if entry["method"] in ("PUT", "POST", "DELETE")
        ]
        self.journal.write_text("".join(json.dumps(entry) + "\n" for entry in writes))  # replay reads lines
        self.start()
        request = urllib.request.Request(
            f"http://127.0.0.1:{self.port}/moto-api/recorder/replay-recording", method="POST"
        )
        with urllib.request.urlopen(request, timeout=120) as reply:
            assert reply.status == 200

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait(timeout=10)
