"""A small driver for headless Chromium over the DevTools protocol on a pipe (no websocket, no
extra package): open a page at a given width, run script in it, choose an option as a visitor
does (set a select's value and fire its change event, as a browser does when one is picked), and
take a screenshot."""

from __future__ import annotations

import base64
import fcntl
import json
import os
import subprocess
import time
from pathlib import Path
from typing import Any, Optional


class Browser:
    def __init__(self, chromium: str, profile: Path):
        self._to_chrome_r, self._to_chrome_w = os.pipe()
        self._from_chrome_r, self._from_chrome_w = os.pipe()
        self.proc = subprocess.Popen(
            [chromium, "--headless", "--no-sandbox", "--disable-gpu", "--no-first-run", "--disable-sync",
             "--disable-background-networking", "--disable-component-update", f"--user-data-dir={profile}",
             "--remote-debugging-pipe"],
            # The protocol's pipe is the child's fds 3 (commands in) and 4 (replies out).
            close_fds=False, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
            preexec_fn=self._child_fds)
        os.close(self._to_chrome_r)
        os.close(self._from_chrome_w)
        self._buf = b""
        self._id = 0
        self.events: list[dict] = []
        target = self.send("Target.createTarget", url="about:blank")["targetId"]
        self.session = self.send("Target.attachToTarget", targetId=target, flatten=True)["sessionId"]
        self.send("Page.enable", session=True)
        self.send("Runtime.enable", session=True)

    def _child_fds(self) -> None:
        # Moved out of the way first: a pipe end may itself be fd 3 or 4.
        commands = fcntl.fcntl(self._to_chrome_r, fcntl.F_DUPFD, 10)
        replies = fcntl.fcntl(self._from_chrome_w, fcntl.F_DUPFD, 10)
        os.dup2(commands, 3)
        os.dup2(replies, 4)

    def _read(self, timeout: float) -> dict:
        deadline = time.monotonic() + timeout
        while b"\0" not in self._buf:
            if time.monotonic() > deadline:
                raise TimeoutError("no answer from Chromium")
            chunk = os.read(self._from_chrome_r, 1 << 20)
            if not chunk:
                raise RuntimeError("Chromium closed the pipe")
            self._buf += chunk
        msg, self._buf = self._buf.split(b"\0", 1)
        return json.loads(msg)

    def send(self, method: str, session: bool = False, timeout: float = 60, **params) -> dict:
        self._id += 1
        msg: dict[str, Any] = {"id": self._id, "method": method, "params": params}
        if session:
            msg["sessionId"] = self.session
        os.write(self._to_chrome_w, json.dumps(msg).encode() + b"\0")
        while True:
            reply = self._read(timeout)
            if reply.get("id") == self._id:
                if "error" in reply:
                    raise RuntimeError(f"{method}: {reply['error']}")
                return reply.get("result", {})
            self.events.append(reply)

    def wait_event(self, method: str, timeout: float = 60) -> dict:
        for i, e in enumerate(self.events):
            if e.get("method") == method:
                return self.events.pop(i)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            e = self._read(deadline - time.monotonic())
            if e.get("method") == method:
                return e
            self.events.append(e)
        raise TimeoutError(method)

    def open(self, url: str, width: int, height: int = 900) -> None:
        self.send("Emulation.setDeviceMetricsOverride", session=True, width=width, height=height,
                  deviceScaleFactor=1, mobile=width < 600)
        self.events = [e for e in self.events if e.get("method") != "Page.loadEventFired"]
        self.send("Page.navigate", session=True, url=url)
        self.wait_event("Page.loadEventFired")

    def eval(self, expression: str) -> Any:
        result = self.send("Runtime.evaluate", session=True, expression=expression, returnByValue=True,
                           awaitPromise=True)
        if "exceptionDetails" in result:
            raise RuntimeError(result["exceptionDetails"])
        return result["result"].get("value")

    def choose(self, select_name: str, value: str) -> None:
        """One interaction: pick ``value`` in the form's select ``select_name``."""
        ok = self.eval(f"""(() => {{ const s = document.querySelector('select[name={json.dumps(select_name)}]');
            if (!s || ![...s.options].some(o => o.value === {json.dumps(value)})) return false;
            s.value = {json.dumps(value)}; s.dispatchEvent(new Event('change', {{bubbles: true}})); return true; }})()""")
        if not ok:
            raise AssertionError(f"no option {value!r} in select {select_name!r}")

    def wait_for(self, expression: str, timeout: float = 10) -> Any:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            value = self.eval(expression)
            if value:
                return value
            time.sleep(0.05)
        raise TimeoutError(expression)

    def screenshot(self, path: Path) -> None:
        data = self.send("Page.captureScreenshot", session=True, format="png", captureBeyondViewport=False)["data"]
        path.write_bytes(base64.b64decode(data))

    def close(self) -> None:
        try:
            self.send("Browser.close", timeout=10)
        except Exception:
            pass
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        os.close(self._to_chrome_w)
        os.close(self._from_chrome_r)


def open_browser(chromium: str, profile: Path) -> Optional[Browser]:
    return Browser(chromium, profile)
