"""Loading a tensorflow-datasets data set only when it is there or can be downloaded.

Offline, ``tfds.load`` retries every download for minutes (210 s measured for
``mnist`` on a machine without a network), ends in a 60-line `requests`
traceback, and leaves a ``<data_dir>/<name>`` folder without
``dataset_info.json`` that tensorflow-datasets then takes for the prepared data
set on the next run. `prepare` instead:

1. goes on at once when the data set is prepared in the data folder;
2. stops at once, naming the folder, when the data set's version folder is there
   but incomplete (no ``dataset_info.json``);
3. else connects to the download host (or the proxy that `requests` would use)
   with a short timeout, and stops with what is missing and how to provide it
   when nothing answers;
4. else downloads and prepares it, removing the folders this run created when
   that fails.
"""

from __future__ import annotations

import pathlib
import shutil
import socket
import tempfile
import urllib.parse
import urllib.request
from typing import Callable, List, Optional

# Where tensorflow-datasets 4.9 downloads each data set the examples use.
# Sources: tensorflow_datasets/image_classification/mnist.py (_MNIST_URL),
# image_classification/cifar.py (Cifar10 download url),
# datasets/imdb_reviews/imdb_reviews_dataset_builder.py (_DOWNLOAD_URL).
DOWNLOAD_URLS = {
    "mnist": "https://storage.googleapis.com/cvdf-datasets/mnist/",
    "cifar10": "https://www.cs.toronto.edu/~kriz/cifar-10-binary.tar.gz",
    "imdb_reviews": "http://ai.stanford.edu/~amaas/data/sentiment/aclImdb_v1.tar.gz",
}
#: Seconds to wait for the download host to accept a connection.
CONNECT_TIMEOUT = 3.0


def _endpoint(url: str) -> tuple:
    """``(host, port)`` a download of `url` connects to: its proxy's if one is set."""
    parts = urllib.parse.urlsplit(url)
    proxy = urllib.request.getproxies().get(parts.scheme)
    if proxy and not urllib.request.proxy_bypass(parts.hostname):
        proxy_parts = urllib.parse.urlsplit(proxy if "://" in proxy else "http://" + proxy)
        return proxy_parts.hostname, proxy_parts.port or 80
    return parts.hostname, parts.port or (443 if parts.scheme == "https" else 80)


def host_reachable(url: str, timeout: float = CONNECT_TIMEOUT) -> bool:
    """Whether a TCP connection to the host serving `url` opens within `timeout`.

    Args:
        url: String. The download URL (``http://`` or ``https://``).
        timeout: Float, seconds.

    Returns:
        Bool. False when the name does not resolve or nothing answers in time.
    """
    try:
        with socket.create_connection(_endpoint(url), timeout=timeout):
            return True
    except OSError:  # no name resolution, refused or timed out: not reachable
        return False


def _how_to_provide(name: str, version: str, root: pathlib.Path) -> str:
    return (
        "To provide it:\n"
        f"  - point TFDS_DATA_DIR (or --data-dir) at a folder that holds {name}/ "
        f"prepared (version {version}), or\n"
        f"  - on a machine with a network, run `tfds build {name}` (or this example), "
        f"then copy its ~/tensorflow_datasets/{name} folder into {root}.\n"
        "No network at all? `python examples/train_digits.py --dataset digits` (its "
        "default) trains on scikit-learn's bundled digits."
    )


def tfds_builder(name: str, data_dir: Optional[str] = None):
    """``tfds.builder(name, data_dir=data_dir)``, leaving no folder in the system's temporary folder.

    For a data set not yet prepared, tensorflow-datasets (4.9) makes a ``tempfile.mkdtemp("tfds")``
    folder for metadata from its bucket and leaves it behind, empty when the bucket is off (its
    default): one more folder in /tmp per run. Here that folder is made inside a temporary
    folder of this call's own, removed when the builder is made.

    Args:
        name: String. A tensorflow-datasets data set name, e.g. "mnist".
        data_dir: String or None, as `prepare`'s.

    Returns:
        `tfds.core.DatasetBuilder` of `name`.
    """
    import tensorflow_datasets as tfds

    with tempfile.TemporaryDirectory(prefix="tfmp-tfds-") as scratch:
        default, tempfile.tempdir = tempfile.tempdir, scratch
        try:
            return tfds.builder(name, data_dir=data_dir)
        finally:
            tempfile.tempdir = default


def prepare(
    name: str,
    data_dir: Optional[str] = None,
    *,
    reachable: Optional[Callable[[str], bool]] = None,
):
    """Returns the tensorflow-datasets builder of `name`, prepared, or exits with why.

    Args:
        name: String. One of `DOWNLOAD_URLS`: "mnist", "cifar10", "imdb_reviews".
        data_dir: String or None. Folder of prepared data sets; None uses
            tensorflow-datasets' default (``$TFDS_DATA_DIR``, else
            ``~/tensorflow_datasets``).
        reachable: Callable taking a URL and returning a bool, or None for
            `host_reachable` (looked up when called, so tests can replace it).

    Returns:
        `tfds.core.DatasetBuilder` of `name`, its data prepared (read it with
        ``builder.as_dataset(...)``).

    Raises:
        SystemExit: (exit status 1, with the message) the data set is not
            prepared and its download host does not answer; its version folder
            is incomplete; or downloading it failed, after removing the folders
            this run created.
        ValueError: `name` is not in `DOWNLOAD_URLS`.
    """
    if name not in DOWNLOAD_URLS:
        raise ValueError(
            f"Invalid `name` argument. Expected one of {sorted(DOWNLOAD_URLS)}. "
            f"Received: name={name!r}. Add its download URL to DOWNLOAD_URLS."
        )
    builder = tfds_builder(name, data_dir)
    version, root = str(builder.version), pathlib.Path(builder.data_dir_root)
    where = f"tensorflow-datasets data set {name!r} (version {version})"
    target = pathlib.Path(builder.data_dir)
    if target.exists():  # (is_prepared() logs a warning about a missing folder)
        if builder.is_prepared():
            return builder
        raise SystemExit(
            f"{where}: the folder {target} is incomplete (no dataset_info.json), "
            "left by an interrupted download. Remove it and run again."
        )
    url = DOWNLOAD_URLS[name]
    if not (reachable or host_reachable)(url):
        host, port = _endpoint(url)
        raise SystemExit(
            f"{where} is not prepared in {root}, and its download host {host}:{port} "
            f"did not answer within {CONNECT_TIMEOUT:g} s (no network?).\n"
            + _how_to_provide(name, version, root)
        )
    created = _missing_folders(root, name)
    try:
        builder.download_and_prepare()
    except Exception as error:
        for folder in created:
            if folder.exists():
                shutil.rmtree(folder)
        raise SystemExit(
            f"{where}: the download into {root} failed ({type(error).__name__}: "
            f"{error}); the folders it had created are removed.\n"
            + _how_to_provide(name, version, root)
        ) from error
    return builder


def _missing_folders(root: pathlib.Path, name: str) -> List[pathlib.Path]:
    """The folders a download of `name` creates under `root` that do not exist yet.

    tensorflow-datasets writes ``<root>/<name>/...`` (data, and the default
    config's name for data sets with configs) and ``<root>/downloads``.
    """
    if not root.exists():
        return [root]
    return [folder for folder in (root / name, root / "downloads") if not folder.exists()]
