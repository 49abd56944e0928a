"""A real headless Chromium for tests, driven over the DevTools protocol (websockets), that can never hang.

`Chromium().render(page, script, screenshot)` opens a local HTML file in a new tab with every host name
unresolvable, records every request the page makes, evaluates `script` (an async JavaScript expression) once
the page has loaded, saves a screenshot and returns (the script's value, the requests). One Chromium serves
a test session (the `browser` fixture of tests/conftest.py); it runs in a new process group with stdin
closed and is killed when the session ends; every wait has a deadline.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import tempfile
import time
import urllib.request
from base64 import b64decode
from contextlib import ExitStack
from pathlib import Path

from helpers.polling import wait_for

ROOT = Path(__file__).resolve().parents[2]
FLAGS = [
    "--headless=new",
    "--no-sandbox",
    "--disable-gpu",
    "--no-first-run",
    "--no-default-browser-check",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--mute-audio",
    "--disable-dev-shm-usage",
    "--autoplay-policy=no-user-gesture-required",
    "--host-resolver-rules=MAP * ~NOTFOUND",  # any host name fails to resolve: nothing reaches a network
    "--remote-debugging-port=0",
    "--window-size=1400,1800",
]


def chromium() -> str:
    """The browser binary; scripts/ensure_browser.sh installs Debian's chromium where there is none."""
    out = subprocess.run(
        [str(ROOT / "scripts" / "ensure_browser.sh")],
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=850,
    )  # under pytest-timeout's 900 s
    if out.returncode != 0:
        raise RuntimeError(f"no Chromium: {out.stderr.strip()[-2000:]}")
    return out.stdout.strip().splitlines()[-1]


class DevTools:
    """One page's DevTools connection: `call` waits for its reply, keeping the events that came first."""

    def __init__(self, url: str, deadline: float):
        from websockets.sync.client import connect

        self.deadline = deadline
        self._stack = ExitStack()
        self.ws = self._stack.enter_context(connect(url, max_size=None, open_timeout=self._left()))
        self.events: list[dict] = []
        self._id = 0

    def _left(self) -> float:
        left = self.deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError("the browser did not answer in time")
        return left

    def call(self, method: str, **params) -> dict:
        self._id += 1
        self.ws.send(json.dumps({"id": self._id, "method": method, "params": params}))
        while True:
            message = json.loads(self.ws.recv(timeout=self._left()))
            if message.get("id") == self._id:
                if "error" in message:
                    raise RuntimeError(f"{method}: {message['error']}")
                return message.get("result", {})
            self.events.append(message)

    def wait_event(self, method: str) -> dict:
        while True:
            for event in self.events:
                if event.get("method") == method:
                    return event
            self.events.append(json.loads(self.ws.recv(timeout=self._left())))

    def close(self) -> None:
        self._stack.close()


def _wait_for_port(profile: Path, proc: subprocess.Popen, timeout: float) -> int:
    """Chromium writes the port it listens on into DevToolsActivePort once it is ready."""
    marker = profile / "DevToolsActivePort"

    def ready() -> str:
        if proc.poll() is not None:
            raise RuntimeError(f"chromium exited with {proc.returncode} before it was ready")
        return marker.is_file() and marker.read_text().strip()

    return int(wait_for(ready, timeout=timeout, what="chromium's DevTools port").split()[0])


class Chromium:
    """One headless Chromium for many pages (the tests' session-scoped `browser` fixture): started once, each
    `render` in a tab of its own (a new DevTools target, closed after it), so a page sees only its own requests.
    Start and every page have their deadlines; `close` kills the browser's process group."""

    def __init__(self, timeout: float = 90.0):
        binary = chromium()
        deadline = time.monotonic() + timeout
        self.profile = Path(tempfile.mkdtemp(prefix="vt-chromium-"))
        self.log = open(self.profile.parent / f"{self.profile.name}.log", "wb")
        self.proc = subprocess.Popen(
            [binary, *FLAGS, f"--user-data-dir={self.profile}", "about:blank"],
            stdin=subprocess.DEVNULL,
            stdout=self.log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        try:
            self.port = _wait_for_port(self.profile, self.proc, max(deadline - time.monotonic(), 1.0))
        except BaseException:
            self.close()
            raise

    def _endpoint(self, path: str, deadline: float, method: str = "GET") -> dict:
        if self.proc.poll() is not None:
            raise RuntimeError(f"chromium exited with {self.proc.returncode}; see {self.log.name}")
        request = urllib.request.Request(f"http://127.0.0.1:{self.port}{path}", method=method)
        with urllib.request.urlopen(request, timeout=max(min(10.0, deadline - time.monotonic()), 0.1)) as reply:
            return json.load(reply)

    def render(self, page: Path, script: str, screenshot: Path, timeout: float = 90.0) -> tuple[object, list[dict]]:
        """Open `page` (a local file) in a new tab, evaluate `script` after load; returns (its value, requests
        seen)."""
        deadline = time.monotonic() + timeout
        target = self._endpoint("/json/new?about:blank", deadline, method="PUT")
        tools = None
        try:
            tools = DevTools(target["webSocketDebuggerUrl"], deadline)
            tools.call("Network.enable")
            tools.call("Page.enable")
            tools.call("Page.navigate", url=page.resolve().as_uri())
            tools.wait_event("Page.loadEventFired")
            result = tools.call("Runtime.evaluate", expression=script, awaitPromise=True, returnByValue=True)
            if "exceptionDetails" in result:
                raise RuntimeError(f"the page's check failed: {result['exceptionDetails']}")
            shot = tools.call("Page.captureScreenshot", format="png", captureBeyondViewport=True)
            screenshot.write_bytes(b64decode(shot["data"]))
            requests = [
                {"url": e["params"]["request"]["url"]}
                for e in tools.events
                if e.get("method") == "Network.requestWillBeSent"
            ]
            failed = [e["params"] for e in tools.events if e.get("method") == "Network.loadingFailed"]
            return result["result"].get("value"), requests + [{"failed": f} for f in failed]
        finally:
            if tools is not None:
                tools.close()
            try:  # the tab goes; a browser that no longer answers fails the next page, not this one's result
                with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/json/close/{target['id']}", timeout=10):
                    pass
            except OSError:
                pass

    def close(self) -> None:
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait(timeout=30)
        self.log.close()
        shutil.rmtree(self.profile, ignore_errors=True)
