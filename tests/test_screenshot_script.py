"""scripts/tensorboard_screenshot.py without a browser: options, command line, relay."""

import http.server
import pathlib
import re
import sys
import threading
import urllib.request

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))

import tensorboard_screenshot as shot  # noqa: E402


def test_help_explains_every_option(capsys):
    with pytest.raises(SystemExit) as exit_info:
        shot.parse_args(["--help"])
    assert exit_info.value.code == 0
    out = capsys.readouterr().out
    for word in ("logdir", "--output", "--dashboard", "timeseries", "custom_scalars", "--window-size",
                 "--smoothing", "--budget-ms", "--timeout", "--chromium", "127.0.0.1"):
        assert word in out, word


def test_defaults(tmp_path):
    args = shot.parse_args([str(tmp_path)])
    assert (args.output, args.dashboard, args.window_size, args.smoothing, args.budget_ms) == (
        "tensorboard.png", "timeseries", "1400,2400", 0.0, 20000)


@pytest.mark.parametrize(
    "argv, message",
    [(["--window-size", "wide"], r"--window-size expects WIDTH,HEIGHT.*received 'wide'"),
     (["--window-size", "0,10"], r"received '0,10'"),
     (["--smoothing", "1"], r"--smoothing expects a number in \[0, 1\), received 1.0"),
     (["--budget-ms", "0"], r"--budget-ms expects a whole number >= 1, received 0")],
)
def test_bad_options_are_usage_errors(tmp_path, capsys, argv, message):
    with pytest.raises(SystemExit) as exit_info:
        shot.parse_args([str(tmp_path), *argv])
    assert exit_info.value.code == 2
    assert re.search(message, capsys.readouterr().err)


def test_missing_logdir_names_the_fix(tmp_path, capsys):
    with pytest.raises(SystemExit):
        shot.parse_args([str(tmp_path / "nothing")])
    assert "is not a folder; run e.g. python examples/train_digits.py" in capsys.readouterr().err


def test_missing_chromium_names_the_fix():
    with pytest.raises(FileNotFoundError, match=r"no-such-browser.*apt-get install -y chromium"):
        shot.find_chromium("no-such-browser")


def test_chromium_command_is_headless_local_and_fresh(tmp_path):
    command = shot.chromium_command("chromium", "http://127.0.0.1:1/x", "out.png", "800,600",
                                    5000, str(tmp_path))
    for flag in ("--headless", "--no-sandbox", "--disable-gpu", "--disable-quic",
                 "--no-first-run", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync",
                 "--host-resolver-rules=MAP * ~NOTFOUND, EXCLUDE 127.0.0.1",
                 f"--user-data-dir={tmp_path}", "--screenshot=out.png",
                 "--window-size=800,600", "--virtual-time-budget=5000"):
        assert flag in command, flag
    assert command[0] == "chromium" and command[-1] == "http://127.0.0.1:1/x"
    assert shot.page_path("custom_scalars", 0.0) == (
        "/?darkMode=false&forceSVG=true#custom_scalars&_smoothingWeight=0")


class _Backend(http.server.BaseHTTPRequestHandler):
    """Stands in for TensorBoard: answers with the method, path and body it got."""

    def _answer(self, body=b""):
        text = f"{self.command} {self.path} {body.decode()}".encode()
        self.send_response(200)
        self.send_header("Content-Type", "text/plain")
        self.send_header("Content-Length", str(len(text)))
        self.end_headers()
        self.wfile.write(text)

    def do_GET(self):
        self._answer()

    def do_POST(self):
        self._answer(self.rfile.read(int(self.headers["Content-Length"])))

    def log_message(self, *args):
        pass


def test_relay_sets_the_outlier_setting_then_relays():
    backend = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Backend)
    threading.Thread(target=backend.serve_forever, daemon=True).start()
    relay = shot.start_relay(f"http://127.0.0.1:{backend.server_address[1]}", "/dash#x",
                             shot.settings(0.25))
    base = f"http://127.0.0.1:{relay.server_address[1]}"
    try:
        with urllib.request.urlopen(base + shot.SETUP_PATH) as response:
            assert response.read().decode() == (
                "<!doctype html><script>localStorage.setItem('_ignoreYOutliers', "
                "'false');localStorage.setItem(\"_tb_global_settings\", "
                "\"{\\\"ignoreOutliers\\\": false, \\\"scalarSmoothing\\\": 0.25, "
                "\\\"timeSeriesSettingsPaneOpened\\\": false}\");"
                "location.replace(\"/dash#x\");</script>")
        with urllib.request.urlopen(base + "/data/runs?x=1") as response:
            assert response.read() == b"GET /data/runs?x=1 "
            assert response.headers["Content-Type"] == "text/plain"
        with urllib.request.urlopen(base + "/data/post", data=b"k=v") as response:
            assert response.read() == b"POST /data/post k=v"
    finally:
        for server in (relay, backend):
            server.shutdown()
            server.server_close()
