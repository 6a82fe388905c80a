"""Screenshot of TensorBoard for a log folder, taken by headless Chromium.

Serves TensorBoard on 127.0.0.1 for `logdir`, waits until it lists the run's
data, opens one dashboard (by default Time Series, the tab TensorBoard opens on)
in headless Chromium and saves the page as a PNG, then stops the server. Nothing
is fetched from the network: TensorBoard serves its own front end, and Chromium
resolves every host but 127.0.0.1 to "not found". Chromium reaches TensorBoard
through a small same-origin relay whose first page writes TensorBoard's settings
to the browser's local storage: "Ignore outliers in chart scaling" off (so every
logged value is inside the charts), the chosen smoothing, and the Time Series
settings pane closed (so the cards get the width). The PNG goes where
``--output`` says (default ``tensorboard.png`` in the current folder); nothing
else is written. The README's pictures of the main job come from:

    python examples/train_digits.py --policy mixed_bfloat16 --filters 4 --units 16 \\
        --log-dir logs/digits_bf16
    python scripts/tensorboard_screenshot.py logs/digits_bf16 \\
        --output docs/images/tensorboard_main_job.png --window-size 1400,1650
    python examples/train_digits.py --policy mixed_float16 --filters 4 --units 16 \\
        --log-dir logs/digits_fp16
    python scripts/tensorboard_screenshot.py logs/digits_fp16 --dashboard custom_scalars \\
        --output docs/images/tensorboard_main_job_fp16.png

Needs TensorBoard (a dependency of tfmp) and Chromium (Debian: ``apt-get
install chromium``). With Pillow installed the PNG is stored with a 256-colour
palette, which keeps chart screenshots small.
"""

from __future__ import annotations

import argparse
import http.server
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from typing import Any, List, Optional, Sequence

DASHBOARDS = ("timeseries", "custom_scalars", "scalars", "text")
CHROMIUM_NAMES = ("chromium", "chromium-browser", "google-chrome")


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description="Serve TensorBoard on 127.0.0.1 for a log folder and save a "
        "headless-Chromium screenshot of one dashboard as PNG."
    )
    parser.add_argument("logdir", help="TensorBoard log folder (e.g. logs/digits)")
    parser.add_argument("--output", default="tensorboard.png",
                        help="PNG file to write (default tensorboard.png)")
    parser.add_argument("--dashboard", choices=DASHBOARDS, default="timeseries",
                        help="TensorBoard tab to capture (default timeseries, the tab "
                        "TensorBoard opens on)")
    parser.add_argument("--window-size", default="1400,2400",
                        help="browser window WIDTH,HEIGHT in pixels (default 1400,2400)")
    parser.add_argument("--smoothing", type=float, default=0.0,
                        help="TensorBoard's chart smoothing in [0, 1) (default 0: "
                        "raw values, so each halving of the loss scale shows)")
    parser.add_argument("--budget-ms", type=int, default=20000,
                        help="virtual time Chromium lets the page run before the "
                        "shot, in milliseconds (default 20000)")
    parser.add_argument("--timeout", type=float, default=120.0,
                        help="seconds to wait for TensorBoard and for Chromium (default 120)")
    parser.add_argument("--chromium", default=None,
                        help="Chromium executable (default: the first of "
                        f"{', '.join(CHROMIUM_NAMES)} on PATH)")
    args = parser.parse_args(argv)
    try:
        width, height = (int(part) for part in args.window_size.split(","))
    except ValueError:
        width = height = 0
    if width < 1 or height < 1:
        parser.error(f"--window-size expects WIDTH,HEIGHT in pixels, e.g. 1400,1500; "
                     f"received {args.window_size!r}")
    if not 0.0 <= args.smoothing < 1.0:
        parser.error(f"--smoothing expects a number in [0, 1), received {args.smoothing}")
    if args.budget_ms < 1:
        parser.error(f"--budget-ms expects a whole number >= 1, received {args.budget_ms}")
    if not os.path.isdir(args.logdir):
        parser.error(f"logdir {args.logdir!r} is not a folder; run e.g. "
                     "python examples/train_digits.py first")
    return args


def find_chromium(explicit: Optional[str]) -> str:
    """The Chromium executable to run; raises FileNotFoundError naming the fix."""
    for name in ([explicit] if explicit else CHROMIUM_NAMES):
        path = shutil.which(name)
        if path:
            return path
    raise FileNotFoundError(
        f"No Chromium found (looked for {explicit or ', '.join(CHROMIUM_NAMES)}). "
        "Install it (Debian: apt-get install -y chromium) or pass --chromium PATH."
    )


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def wait_for_runs(url: str, server: subprocess.Popen, timeout: float) -> List[str]:
    """Polls TensorBoard's run list until it names a run; returns the runs."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if server.poll() is not None:
            raise RuntimeError(f"TensorBoard exited with code {server.returncode}")
        try:
            with urllib.request.urlopen(f"{url}/data/runs", timeout=5) as response:
                runs = json.load(response)
            if runs:
                return runs
        except (urllib.error.URLError, ConnectionError, json.JSONDecodeError):
            pass
        time.sleep(0.5)
    raise TimeoutError(f"TensorBoard at {url} listed no run within {timeout} s")


def page_path(dashboard: str, smoothing: float) -> str:
    """The dashboard's path: light theme, charts drawn as SVG (a headless browser's
    shot can come before the default canvas worker draws), the smoothing in the fragment."""
    return f"/?darkMode=false&forceSVG=true#{dashboard}&_smoothingWeight={smoothing:g}"


SETUP_PATH = "/__screenshot_setup"
#: TensorBoard's local-storage key of its settings (read by every dashboard).
SETTINGS_KEY = "_tb_global_settings"


def settings(smoothing: float) -> dict:
    """TensorBoard's settings for the shot: every value in the charts, `smoothing`, no side pane."""
    return {"ignoreOutliers": False, "scalarSmoothing": smoothing, "timeSeriesSettingsPaneOpened": False}


class _Relay(http.server.BaseHTTPRequestHandler):
    """Relays GET/POST to TensorBoard; `SETUP_PATH` sets local storage, then opens the page."""

    target = ""  # TensorBoard's address
    page = ""  # the dashboard path to open after the setup
    settings: dict = {}  # TensorBoard's settings written at the setup

    def do_GET(self) -> None:  # noqa: N802 (http.server's naming)
        if self.path == SETUP_PATH:
            script = (f"localStorage.setItem('_ignoreYOutliers', 'false');"
                      f"localStorage.setItem({json.dumps(SETTINGS_KEY)}, "
                      f"{json.dumps(json.dumps(self.settings))});"
                      f"location.replace({json.dumps(self.page)});")
            self._reply(200, {"Content-Type": "text/html"},
                        f"<!doctype html><script>{script}</script>".encode())
        else:
            self._relay(None)

    def do_POST(self) -> None:  # noqa: N802
        length = int(self.headers.get("Content-Length") or 0)
        self._relay(self.rfile.read(length))

    def _relay(self, body: Optional[bytes]) -> None:
        headers = {k: v for k, v in self.headers.items()
                   if k.lower() in ("content-type", "accept", "x-xsrf-protected")}
        request = urllib.request.Request(self.target + self.path, data=body, headers=headers)
        try:
            with urllib.request.urlopen(request, timeout=60) as response:
                self._reply(response.status, response.headers, response.read())
        except urllib.error.HTTPError as error:
            self._reply(error.code, error.headers, error.read())
        except urllib.error.URLError as error:  # TensorBoard gone: say so to the browser
            self._reply(502, {"Content-Type": "text/plain"}, str(error).encode())

    def _reply(self, status: int, headers: Any, body: bytes) -> None:
        self.send_response(status)
        for key in ("Content-Type", "Content-Encoding", "Cache-Control"):
            if headers.get(key):
                self.send_header(key, headers[key])
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: Any) -> None:
        pass  # quiet


def start_relay(target: str, page: str, tb_settings: Optional[dict] = None) -> http.server.ThreadingHTTPServer:
    """Serves `_Relay` on a free 127.0.0.1 port in a daemon thread; its setup writes `tb_settings`."""
    handler = type("Relay", (_Relay,), {"target": target, "page": page,
                                        "settings": dict(tb_settings or {})})
    relay = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=relay.serve_forever, daemon=True).start()
    return relay


def chromium_command(chromium: str, url: str, output: str, window: str,
                     budget_ms: int, profile: str) -> List[str]:
    """The headless Chromium command line: local only, no GPU, fresh profile."""
    return [
        chromium, "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic",
        "--no-first-run", "--disable-background-networking",
        "--disable-component-update", "--disable-sync", "--hide-scrollbars",
        "--host-resolver-rules=MAP * ~NOTFOUND, EXCLUDE 127.0.0.1",
        f"--user-data-dir={profile}", f"--screenshot={output}",
        f"--window-size={window}", f"--virtual-time-budget={budget_ms}", url,
    ]


def shrink_png(path: str) -> None:
    """Re-stores the PNG with a 256-colour palette when Pillow is installed."""
    try:
        from PIL import Image
    except ImportError:
        return
    with Image.open(path) as image:
        small = image.convert("RGB").quantize(colors=256)
    small.save(path, optimize=True)


def main(argv: Optional[Sequence[str]] = None) -> str:
    """Takes the screenshot; returns the PNG's path."""
    args = parse_args(argv)
    chromium = find_chromium(args.chromium)
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    server = subprocess.Popen(
        [sys.executable, "-m", "tensorboard.main", "--logdir", args.logdir,
         "--host", "127.0.0.1", "--port", str(port), "--load_fast", "false",
         "--reload_multifile", "true"],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
    )
    try:
        runs = wait_for_runs(url, server, args.timeout)
        output = os.path.abspath(args.output)
        os.makedirs(os.path.dirname(output), exist_ok=True)
        relay = start_relay(url, page_path(args.dashboard, args.smoothing), settings(args.smoothing))
        try:
            start = f"http://127.0.0.1:{relay.server_address[1]}{SETUP_PATH}"
            with tempfile.TemporaryDirectory(prefix="tb-chromium-") as profile:
                command = chromium_command(chromium, start, output, args.window_size,
                                           args.budget_ms, profile)
                subprocess.run(command, check=True, timeout=args.timeout,
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        finally:
            relay.shutdown()
            relay.server_close()
    finally:
        server.terminate()
        try:
            server.wait(timeout=10)
        except subprocess.TimeoutExpired:
            server.kill()
    if not os.path.isfile(output):
        raise RuntimeError(f"Chromium wrote no screenshot to {output}")
    shrink_png(output)
    print(f"{output}: {args.dashboard} of runs {', '.join(runs)} "
          f"({os.path.getsize(output) // 1024} KiB)")
    return output


if __name__ == "__main__":
    main()
