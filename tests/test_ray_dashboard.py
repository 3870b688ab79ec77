"""The Ray dashboard of a job's local Ray: on by default (127.0.0.1, Ray's token auth), off with
`ray.dashboard=false`, its URL printed once, and a real headless Chromium that opens it through the token
while a job runs and finds the job's named actors and the job.

The browser check runs inside tests/test_ray_pipeline.py (`learning_run`, `test_the_dashboard_showed_...`):
that module already starts its Ray through `init_ray` and runs a long job, so the check starts no job of its
own. This file holds the cheap checks and the browser driver they use (`DashboardWatcher`)."""
from __future__ import annotations

import base64
import json
import os
import re
import select
import signal
import subprocess
import threading
import time
from pathlib import Path

from rayllm_rl.config import load_config
from rayllm_rl.job.config import GRPOJobConfig
from rayllm_rl.job.plan import BUFFER, COLLECTOR, ENV_WORKER, LEARNER, REPLICA
from rayllm_rl.orchestration.ray.session import DASHBOARD_HOST, dashboard_line, local_init_kwargs

JOB_ACTORS = (REPLICA.format(0), ENV_WORKER.format(0), LEARNER.format(0), COLLECTOR, BUFFER)
"""The named actors of a one-replica, one-env-worker, one-learner job, as the dashboard lists them."""
URL_LINE = re.compile(r"^Ray dashboard: (http://\S+) \(token auth on: ", re.M)
"""The line a job prints about its dashboard (session.dashboard_line) when token auth is on."""
TOKEN_DIALOG = "Authentication Token Required"
"""The title of the dialog the dashboard's page shows until it has a valid token."""


def test_the_dashboard_is_on_by_default_on_localhost_and_off_with_ray_dashboard_false():
    on = local_init_kwargs(load_config(GRPOJobConfig, []))
    assert on["include_dashboard"] is True and on["dashboard_host"] == DASHBOARD_HOST == "127.0.0.1"
    off = local_init_kwargs(load_config(GRPOJobConfig, ["ray.dashboard=false"]), num_cpus=2)
    assert off["include_dashboard"] is False and off["num_cpus"] == 2
    assert {k: v for k, v in off.items() if k not in ("include_dashboard", "num_cpus")} == \
        {k: v for k, v in on.items() if k != "include_dashboard"}  # nothing else changes


def test_the_printed_line_says_where_the_token_is(monkeypatch, tmp_path):
    assert dashboard_line(None) is None and dashboard_line("") is None  # no dashboard: nothing printed
    for var in ("RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("RAY_AUTH_MODE", "token")
    line = dashboard_line("127.0.0.1:8265")
    assert URL_LINE.match(line).group(1) == "http://127.0.0.1:8265"
    assert "~/.ray/auth_token" in line and "`ray get-auth-token`" in line
    (tmp_path / "token").write_text("t" * 32 + "\n")
    monkeypatch.setenv("RAY_AUTH_TOKEN_PATH", str(tmp_path / "token"))
    line = dashboard_line("http://10.0.0.5:8265")
    assert f"the token in {tmp_path / 'token'};" in line and token_from_line(line) == "t" * 32
    monkeypatch.setenv("RAY_AUTH_TOKEN", "x" * 32)  # Ray's first source: the line names it, never prints it
    line = dashboard_line("http://10.0.0.5:8265")
    assert "$RAY_AUTH_TOKEN" in line and "x" * 32 not in line and token_from_line(line) == "x" * 32
    monkeypatch.setenv("RAY_AUTH_MODE", "disabled")
    assert dashboard_line("127.0.0.1:8265") == "Ray dashboard: http://127.0.0.1:8265 (token auth off)"


TOKEN_SOURCE = re.compile(r"the page asks for (?:the value of \$(RAY_AUTH_TOKEN)|the token in (\S+));")


def token_from_line(line: str) -> str:
    """The token, from where the job's printed line says it is ($RAY_AUTH_TOKEN, or a file)."""
    found = TOKEN_SOURCE.search(line)
    assert found, f"the line names no token source: {line!r}"
    token = os.environ[found.group(1)] if found.group(1) else Path(found.group(2)).expanduser().read_text()
    assert token.strip(), f"no token where the line says: {line!r}"
    return token.strip()


class PageChanged(RuntimeError):
    """The page navigated (a reload, the dashboard's own reload after the token) while a command ran on it."""


class Chromium:
    """A headless Chromium driven over the DevTools protocol on a pipe (`--remote-debugging-pipe`: JSON
    messages ended by a NUL byte, ours on its fd 3, its answers on fd 4); every wait bounded. In its own
    process group, which `close` ends (the browser's helper processes too, nothing else)."""

    def __init__(self, binary: str, profile_dir: Path, size: tuple[int, int] = (1400, 1000)):
        to_browser, self._w = os.pipe()
        self._r, from_browser = os.pipe()
        self.proc = subprocess.Popen(
            ["bash", "-c", f'exec "$0" "$@" 3<&{to_browser} 4>&{from_browser} {to_browser}<&- {from_browser}>&-',
             binary, "--headless", "--no-sandbox", "--disable-gpu", "--no-first-run", "--remote-debugging-pipe",
             f"--user-data-dir={profile_dir}", f"--window-size={size[0]},{size[1]}", "about:blank"],
            pass_fds=(to_browser, from_browser), stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
            stderr=open(profile_dir / "chromium.log", "w"), start_new_session=True)
        os.close(to_browser)
        os.close(from_browser)
        self._buf, self._id, self._session = b"", 0, None
        self._log = profile_dir / "chromium.log"

    def send(self, method: str, timeout_s: float = 30.0, **params):
        """One DevTools command; its result, or an error naming it (timeout, protocol error, browser gone)."""
        self._id += 1
        message = {"id": self._id, "method": method, "params": params}
        if self._session is not None:
            message["sessionId"] = self._session
        os.write(self._w, json.dumps(message).encode() + b"\0")
        deadline = time.monotonic() + timeout_s
        while True:
            while b"\0" in self._buf:
                raw, self._buf = self._buf.split(b"\0", 1)
                reply = json.loads(raw)
                if reply.get("id") == self._id:
                    if "error" in reply:
                        text = str(reply["error"].get("message", ""))
                        changed = ("navigated or closed", "Cannot find context", "context was destroyed")
                        kind = PageChanged if any(c in text for c in changed) else RuntimeError
                        raise kind(f"chromium: {method}: {reply['error']}")
                    return reply["result"]
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"chromium did not answer {method} within {timeout_s:g}s")
            if select.select([self._r], [], [], left)[0]:
                chunk = os.read(self._r, 1 << 20)
                if not chunk:
                    raise RuntimeError(f"chromium exited during {method}: {self._log.read_text()[-2000:]}")
                self._buf += chunk

    def open_page(self) -> None:
        page = next(t for t in self.send("Target.getTargets")["targetInfos"] if t["type"] == "page")
        self._session = self.send("Target.attachToTarget", targetId=page["targetId"], flatten=True)["sessionId"]
        self.send("Page.enable")

    def evaluate(self, expression: str, timeout_s: float = 30.0):
        result = self.send("Runtime.evaluate", timeout_s, expression=expression, returnByValue=True)
        if "exceptionDetails" in result and "context was destroyed" in str(result["exceptionDetails"]):
            raise PageChanged(f"chromium: {expression}: {result['exceptionDetails']}")
        if "exceptionDetails" in result:
            raise RuntimeError(f"chromium: {expression}: {result['exceptionDetails']}")
        return result["result"].get("value")

    def text(self) -> str:
        """The page's visible text; "" while it is being replaced (a reload)."""
        try:
            return self.evaluate("document.body ? document.body.innerText : ''") or ""
        except PageChanged:
            return ""

    def rows(self) -> list[str]:
        """The visible table rows, each as one line of its cells' text; [] while the page is being replaced."""
        try:
            return self.evaluate("[...document.querySelectorAll('tr')]"
                                 ".map(r => r.innerText.replace(/\\s+/g, ' '))") or []
        except PageChanged:
            return []

    def screenshot(self, path: Path) -> None:
        path.write_bytes(base64.b64decode(self.send("Page.captureScreenshot", 60.0, format="png")["data"]))

    def close(self) -> None:
        try:
            os.killpg(self.proc.pid, signal.SIGTERM)
            self.proc.wait(timeout=15)
        except (ProcessLookupError, subprocess.TimeoutExpired):
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            self.proc.wait(timeout=15)
        finally:
            os.close(self._w)
            os.close(self._r)


def wait_until(what: str, probe, timeout_s: float, stop: threading.Event, every_s: float = 0.5, reload=None,
               reload_every_s: float = 10.0):
    """`probe()` until it returns something true (that value). TimeoutError naming `what` and the last value
    after `timeout_s`; RuntimeError as soon as `stop` is set (the job ended: what is seen later is not of a
    running job). `reload`, if given, is called every `reload_every_s` (a page that does not refresh itself)."""
    deadline, last_reload, value = time.monotonic() + timeout_s, time.monotonic(), None
    while True:
        if stop.is_set():
            raise RuntimeError(f"the job ended before the dashboard showed {what}; last seen: {value!r}")
        value = probe()
        if value:
            return value
        if time.monotonic() >= deadline:
            raise TimeoutError(f"the dashboard did not show {what} within {timeout_s:g}s; last seen: {value!r}")
        if reload is not None and time.monotonic() - last_reload > reload_every_s:
            reload()
            last_reload = time.monotonic()
        time.sleep(every_s)


class DashboardWatcher:
    """In a thread, while a job runs: opens the dashboard at `url` in a fresh headless Chromium, passes the
    token dialog by typing `token` into it (as a user does), then waits until the Actors page lists each of
    `actors` as ALIVE and the Jobs page lists the driver job `job_id` as RUNNING; a screenshot of each page
    in `out_dir`. `result()` returns what it saw, or raises what went wrong."""

    def __init__(self, browser: str, url: str, token: str, actors: tuple[str, ...], namespace: str, job_id: str,
                 out_dir: Path, timeout_s: float = 300.0):
        self.url, self.token, self.actors, self.job_id, self.out_dir = url.rstrip("/"), token, actors, job_id, out_dir
        self.namespace = namespace
        self.timeout_s, self.browser = timeout_s, browser
        self.seen: dict = {}
        self.error: BaseException | None = None
        self.job_done = threading.Event()
        """Set by the test when its job has returned: a row seen after that is not one of a running job."""
        self._thread = threading.Thread(target=self._run, name="dashboard-watcher", daemon=True)
        self._thread.start()

    def result(self, timeout_s: float = 120.0) -> dict:
        self._thread.join(timeout_s)
        if self._thread.is_alive():
            raise TimeoutError(f"the dashboard watcher did not finish within {timeout_s:g}s after the job")
        if self.error is not None:
            raise self.error
        return self.seen

    def _actors_up(self) -> bool:
        """Each of the job's actors exists and has finished its constructor (as Ray knows it)."""
        import ray

        try:
            handles = [ray.get_actor(name, namespace=self.namespace) for name in self.actors]
        except ValueError:
            return False
        try:
            ray.get([h.__ray_ready__.remote() for h in handles], timeout=5.0)
        except ray.exceptions.GetTimeoutError:
            return False
        return True

    def _run(self) -> None:
        profile = self.out_dir / "chromium-profile"
        profile.mkdir(parents=True, exist_ok=True)
        t0 = time.monotonic()
        deadline = t0 + self.timeout_s
        left = lambda: max(deadline - time.monotonic(), 1.0)  # noqa: E731
        try:  # only timing: the browser opens once the job's actors are up (what it shows is checked below)
            wait_until("(as Ray says) the job's actors up", self._actors_up, left(), self.job_done, every_s=1.0)
            self.seen["actors_up_s"] = time.monotonic() - t0
            browser = Chromium(self.browser, profile)
        except BaseException as exc:  # noqa: BLE001 - reported by result()
            self.error = exc
            return
        try:
            browser.open_page()
            self.seen["browser_s"] = time.monotonic() - t0
            browser.send("Page.navigate", url=f"{self.url}/#/actors")
            self.seen["dialog"] = wait_until("its token dialog", lambda: TOKEN_DIALOG in browser.text(), left(),
                                             self.job_done)
            self.seen["dialog_s"] = time.monotonic() - t0
            browser.evaluate("document.querySelector('input[type=password]').focus()")
            browser.send("Input.insertText", text=self.token)
            for kind in ("keyDown", "keyUp"):  # Enter submits the dialog; the page reloads with its cookie
                browser.send("Input.dispatchKeyEvent", type=kind, key="Enter", code="Enter", windowsVirtualKeyCode=13)

            def alive_rows():
                rows = [r for r in browser.rows() if " ALIVE " in f"{r} "]
                named = {a: r for a in self.actors for r in rows if f" {a} " in f" {r} "}
                return (rows, named) if len(named) == len(self.actors) else None

            reload = lambda: browser.send("Page.reload")  # noqa: E731
            rows, named = wait_until(f"the actors {', '.join(self.actors)} ALIVE", alive_rows, left(), self.job_done,
                                     reload=reload)
            self.seen.update(actor_rows=named, actors_s=time.monotonic() - t0,
                             dialog_gone=TOKEN_DIALOG not in browser.text())
            browser.screenshot(self.out_dir / "ray_dashboard_actors.png")
            browser.send("Page.navigate", url=f"{self.url}/#/jobs")

            def job_row():
                row = next((r for r in browser.rows() if r.strip().startswith(self.job_id)), None)
                return row if row and " RUNNING " in f"{row} " else None

            self.seen["job_row"] = wait_until(f"the job {self.job_id} RUNNING", job_row, left(), self.job_done,
                                              reload=reload)
            self.seen["jobs_s"] = time.monotonic() - t0
            browser.screenshot(self.out_dir / "ray_dashboard_jobs.png")
        except BaseException as exc:  # noqa: BLE001 - reported by result()
            self.error = exc
        finally:
            browser.close()
