"""The Keras and TensorFlow versions tfmp supports, checked at `import tfmp` (every hook module imports this)."""

from __future__ import annotations

import re

import keras
import tensorflow as tf

#: The (Keras, TensorFlow) versions the private accessors were last checked against.
CHECKED_ON = ("3.15.1", "2.21.0")
#: The oldest pair tfmp supports (setup.cfg's lower bounds, a `.ci/run` tier); Keras 4 is not yet known.
MIN_KERAS = (3, 12, 0)
MIN_TENSORFLOW = (2, 17, 0)
BELOW_KERAS = (4, 0, 0)
#: The newest (major, minor) a `.ci/run` tier tests (pinned pre-releases), setup.cfg's upper bounds;
#: `import tfmp` still takes a newer minor.
NEWEST_TESTED_KERAS = (3, 16)
NEWEST_TESTED_TENSORFLOW = (2, 23)


def _version_tuple(version: str) -> tuple:
    """(major, minor, patch) of a version string such as "3.15.1" or "2.16.0rc1"."""
    match = re.match(r"(\d+)(?:\.(\d+))?(?:\.(\d+))?", version)
    return tuple(int(part or 0) for part in match.groups()) if match else (0, 0, 0)


def keras_at_least(version: str) -> bool:
    """Bool. Whether the installed Keras is `version` (e.g. ``"3.15"``) or newer."""
    return _version_tuple(keras.__version__) >= _version_tuple(version)


def check_versions(keras_version: str, tensorflow_version: str) -> None:
    """Raises ImportError, naming both and the fix, for version strings outside the range tfmp is tested on."""
    dotted = lambda v: ".".join(map(str, v))  # noqa: E731
    keras_ok = MIN_KERAS <= _version_tuple(keras_version) < BELOW_KERAS
    tensorflow_ok = _version_tuple(tensorflow_version) >= MIN_TENSORFLOW
    if keras_ok and tensorflow_ok:
        return
    raise ImportError(
        f"tfmp supports Keras >= {dotted(MIN_KERAS)}, < {dotted(BELOW_KERAS)} with TensorFlow >= "
        f"{dotted(MIN_TENSORFLOW)}. Received: keras=={keras_version}, tensorflow=={tensorflow_version}. "
        f"Install a supported pair, e.g. pip install 'keras>={dotted(MIN_KERAS)},<4' "
        f"'tensorflow>={dotted(MIN_TENSORFLOW)}'."
    )


check_versions(keras.__version__, tf.__version__)
