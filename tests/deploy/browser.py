"""A headless chromium driven over the DevTools protocol on a pipe (--remote-debugging-pipe: the
browser reads commands on fd 3 and writes answers and events on fd 4, each a JSON message ended
by a NUL byte). Standard library only, no network port: the browser talks to nothing but the
pages it is sent to.
"""

import base64
import json
import os
import select
import subprocess
import tempfile
import time

from stack import SCALE

# A closed network: nothing but the page's own origin.
FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
         "--disable-component-update", "--disable-sync", "--no-first-run", "--disable-extensions",
         "--disable-default-apps"]


class BrowserError(AssertionError):
    pass


class Browser:
    """One chromium process with one page. Console messages and uncaught exceptions are kept in
    `console` (as "level: text")."""

    def __init__(self, chromium: str, directory: str, width: int = 1400, height: int = 1600):
        self.console = []
        self._next_id = 0
        self._buffer = b""
        self._events = []
        commands_r, self._commands = os.pipe()
        self._answers, answers_w = os.pipe()
        profile = tempfile.mkdtemp(dir=directory)

        def to_fds_3_and_4():
            # Copies first: a pipe may already be fd 3 or 4, and dup2 onto itself would leave it
            # close-on-exec.
            commands, answers = os.dup(commands_r), os.dup(answers_w)
            os.dup2(commands, 3)
            os.dup2(answers, 4)

        self._log = open(os.path.join(directory, "chromium.log"), "w")
        self.process = subprocess.Popen(
            [chromium, *FLAGS, f"--user-data-dir={profile}", "--remote-debugging-pipe",
             f"--window-size={width},{height}", "about:blank"],
            stdin=subprocess.DEVNULL, stdout=self._log, stderr=self._log, close_fds=False,
            preexec_fn=to_fds_3_and_4)
        os.close(commands_r)
        os.close(answers_w)
        targets = self.call("Target.getTargets")["targetInfos"]
        page = next(t for t in targets if t["type"] == "page")
        self._session = self.call("Target.attachToTarget", targetId=page["targetId"], flatten=True)["sessionId"]
        self.call("Runtime.enable", session=True)
        self.call("Log.enable", session=True)
        self.call("Page.enable", session=True)
        self.call("Emulation.setDeviceMetricsOverride", session=True, width=width, height=height,
                  deviceScaleFactor=1, mobile=False)

    def close(self):
        try:
            self.call("Browser.close", timeout=10)
        except (BrowserError, OSError):
            pass
        try:
            self.process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
        for fd in (self._commands, self._answers):
            try:
                os.close(fd)
            except OSError:
                pass
        self._log.close()

    # -- protocol ------------------------------------------------------------------------------

    def _read_message(self, deadline):
        while b"\0" not in self._buffer:
            left = deadline - time.monotonic()
            if left <= 0:
                raise BrowserError("chromium did not answer in time")
            ready, _, _ = select.select([self._answers], [], [], left)
            if not ready:
                continue
            chunk = os.read(self._answers, 1 << 20)
            if not chunk:
                raise BrowserError(f"chromium closed its pipe (exit {self.process.poll()})")
            self._buffer += chunk
        message, self._buffer = self._buffer.split(b"\0", 1)
        return json.loads(message)

    def _note(self, message):
        method = message.get("method", "")
        params = message.get("params", {})
        if method == "Runtime.consoleAPICalled":
            text = " ".join(str(a.get("value", a.get("description", ""))) for a in params.get("args", []))
            self.console.append(f"{params.get('type')}: {text}")
        elif method == "Runtime.exceptionThrown":
            details = params.get("exceptionDetails", {})
            self.console.append("exception: " + details.get("exception", {}).get("description", details.get("text", "")))
        elif method == "Log.entryAdded":
            entry = params.get("entry", {})
            if entry.get("level") in ("error", "warning"):
                self.console.append(f"{entry.get('level')}: {entry.get('text')} {entry.get('url', '')}".strip())

    def call(self, method, session=False, timeout=60, **params):
        self._next_id += 1
        request = {"id": self._next_id, "method": method, "params": params}
        if session:
            request["sessionId"] = self._session
        os.write(self._commands, json.dumps(request).encode() + b"\0")
        deadline = time.monotonic() + timeout * SCALE
        while True:
            message = self._read_message(deadline)
            if message.get("id") == self._next_id:
                if "error" in message:
                    raise BrowserError(f"{method}: {message['error']}")
                return message.get("result", {})
            self._note(message)

    # -- the page ------------------------------------------------------------------------------

    def navigate(self, url):
        self.call("Page.navigate", session=True, url=url)

    def evaluate(self, expression):
        """The JSON value of a JavaScript expression in the page (promises are awaited)."""
        result = self.call("Runtime.evaluate", session=True, expression=expression, returnByValue=True,
                           awaitPromise=True)
        if "exceptionDetails" in result:
            raise BrowserError(f"{expression}: {result['exceptionDetails']}")
        return result.get("result", {}).get("value")

    def wait_for(self, expression, seconds, what):
        """The first true value of expression, polled until seconds × SCALE have passed."""
        deadline = time.monotonic() + seconds * SCALE
        while True:
            value = self.evaluate(expression)
            if value:
                return value
            if time.monotonic() > deadline:
                raise BrowserError(f"timed out after {seconds * SCALE:.0f} s waiting for {what} ({expression})")
            time.sleep(0.2)

    def drag(self, x0, y, x1, steps=8):
        """A mouse drag with the left button from (x0, y) to (x1, y), in CSS pixels."""
        self.call("Input.dispatchMouseEvent", session=True, type="mouseMoved", x=x0, y=y)
        self.call("Input.dispatchMouseEvent", session=True, type="mousePressed", x=x0, y=y, button="left",
                  clickCount=1)
        for i in range(1, steps + 1):
            self.call("Input.dispatchMouseEvent", session=True, type="mouseMoved", x=x0 + (x1 - x0) * i / steps,
                      y=y, button="left", buttons=1)
        self.call("Input.dispatchMouseEvent", session=True, type="mouseReleased", x=x1, y=y, button="left",
                  clickCount=1)

    def click(self, x, y):
        for kind in ("mousePressed", "mouseReleased"):
            self.call("Input.dispatchMouseEvent", session=True, type=kind, x=x, y=y, button="left", clickCount=1)

    def screenshot(self, path):
        """Saves the whole page as PNG."""
        height = self.evaluate("Math.ceil(document.documentElement.scrollHeight)")
        width = self.evaluate("Math.ceil(document.documentElement.scrollWidth)")
        data = self.call("Page.captureScreenshot", session=True, format="png", captureBeyondViewport=True,
                         clip={"x": 0, "y": 0, "width": width, "height": height, "scale": 1})["data"]
        with open(path, "wb") as f:
            f.write(base64.b64decode(data))
