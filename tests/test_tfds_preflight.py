"""examples/tfds_preflight.py: a missing data set stops at once offline, leaving no folders.

No test here touches the network: an unreachable host is injected, or is a proxy on a
closed local port.
"""

import inspect
import os
import pathlib
import subprocess
import sys
import tempfile

import pytest
import tensorflow_datasets as tfds
from _subproc import ROOT, free_ports, script_env

sys.path.insert(0, str(ROOT / "examples"))

import tfds_preflight  # noqa: E402


def unreachable(url):
    return False


def must_not_connect(url):
    raise AssertionError(f"a prepared data set needs no network, but {url} was checked")


def write_prepared(data_dir, name="mnist"):
    """A prepared-looking data set: the metadata tensorflow-datasets writes last."""
    builder = tfds_preflight.tfds_builder(name, str(data_dir))
    pathlib.Path(builder.data_dir).mkdir(parents=True)
    builder.info.write_to_directory(builder.data_dir)
    return pathlib.Path(builder.data_dir)


def test_download_urls_are_the_ones_tfds_uses():
    for name, url in tfds_preflight.DOWNLOAD_URLS.items():
        module = inspect.getmodule(tfds.builder_cls(name))
        assert url in inspect.getsource(module), name


def test_prepared_data_set_passes_without_network(tmp_path):
    version_dir = write_prepared(tmp_path)
    builder = tfds_preflight.prepare("mnist", str(tmp_path), reachable=must_not_connect)
    assert builder.is_prepared()
    assert pathlib.Path(builder.data_dir) == version_dir
    assert str(builder.version) == "3.0.1"


def test_unreachable_host_stops_with_what_to_do(tmp_path, monkeypatch):
    system_tmp = tmp_path / "system_tmp"  # the system's temporary folder, as tensorflow-datasets sees it
    system_tmp.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(system_tmp))
    data = tmp_path / "data"
    data.mkdir()
    with pytest.raises(SystemExit) as info:
        tfds_preflight.prepare("mnist", str(data), reachable=unreachable)
    message = str(info.value.code)
    for part in ("'mnist' (version 3.0.1)", f"not prepared in {data}",
                 "storage.googleapis.com:443", "TFDS_DATA_DIR", "--data-dir",
                 "tfds build mnist", "--dataset digits"):
        assert part in message, part
    assert list(data.iterdir()) == []
    assert list(system_tmp.iterdir()) == []  # tensorflow-datasets' scratch folder (mkdtemp("tfds")) too


def test_failed_download_removes_only_what_it_created(tmp_path, monkeypatch):
    (tmp_path / "cifar10").mkdir()  # another data set, there before: kept

    def fail_midway(self, *args, **kwargs):
        (tmp_path / "downloads" / "cvdf-datasets").mkdir(parents=True)
        pathlib.Path(self.data_dir).mkdir(parents=True)
        raise ConnectionError("connection reset")

    monkeypatch.setattr(tfds.core.DatasetBuilder, "download_and_prepare", fail_midway)
    with pytest.raises(SystemExit) as info:
        tfds_preflight.prepare("mnist", str(tmp_path), reachable=lambda url: True)
    assert "ConnectionError: connection reset" in str(info.value.code)
    assert "tfds build mnist" in str(info.value.code)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["cifar10"]


def test_incomplete_version_folder_is_named_not_removed(tmp_path):
    version_dir = tmp_path / "mnist" / "3.0.1"
    version_dir.mkdir(parents=True)
    with pytest.raises(SystemExit) as info:
        tfds_preflight.prepare("mnist", str(tmp_path), reachable=must_not_connect)
    assert f"the folder {version_dir} is incomplete (no dataset_info.json)" in str(
        info.value.code)
    assert version_dir.is_dir()


def test_unknown_name_is_a_value_error():
    with pytest.raises(ValueError, match=r"Received: name='svhn'"):
        tfds_preflight.prepare("svhn", reachable=must_not_connect)


def test_proxy_is_the_host_checked(monkeypatch):
    for key in ("https_proxy", "HTTPS_PROXY", "no_proxy", "NO_PROXY"):
        monkeypatch.delenv(key, raising=False)
    url = tfds_preflight.DOWNLOAD_URLS["cifar10"]
    assert tfds_preflight._endpoint(url) == ("www.cs.toronto.edu", 443)
    monkeypatch.setenv("https_proxy", "http://127.0.0.1:3128")
    assert tfds_preflight._endpoint(url) == ("127.0.0.1", 3128)


def test_closed_port_is_unreachable():
    (port,) = free_ports(1)
    assert not tfds_preflight.host_reachable(f"http://127.0.0.1:{port}/data.tar.gz")


def test_example_offline_exits_with_the_message_and_no_folder(tmp_path):
    """As a user runs it, the download host behind a proxy on a closed local port."""
    (port,) = free_ports(1)
    proxy = f"http://127.0.0.1:{port}"
    env = script_env({"https_proxy": proxy, "HTTPS_PROXY": proxy,
                      "http_proxy": proxy, "HTTP_PROXY": proxy})
    for key in ("no_proxy", "NO_PROXY"):
        env.pop(key, None)
    data_dir = tmp_path / "tensorflow_datasets"
    result = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "train_digits.py"), "--dataset", "mnist",
         "--data-dir", str(data_dir), "--log-dir", str(tmp_path / "logs")],
        capture_output=True, text=True, timeout=300, env=env, cwd=tmp_path,
    )
    assert result.returncode == 1, result.stderr[-3000:]
    assert f"did not answer within {tfds_preflight.CONNECT_TIMEOUT:g} s" in result.stderr
    assert f"127.0.0.1:{port}" in result.stderr
    assert "Traceback" not in result.stderr
    assert "has no dataset_info.json" not in result.stderr  # no folder was looked for
    assert os.listdir(tmp_path) == []  # neither data nor logs folder
