"""Optional dependencies stay optional: tfmp imports and trains without them, and the
one call that needs one says which extra installs it, before doing any work.

scipy (the ``compare`` extra) serves only `tfmp.compare`'s statistics;
tensorflow-datasets (the ``examples`` extra) only the examples' ``tfds:`` loaders.
Each case runs in a fresh interpreter where the module cannot be imported
(`_subproc.without_module`).
"""

import os
import subprocess
import sys

import pytest
from _subproc import ROOT, script_env, without_module

COMPARE_WITHOUT_SCIPY = """
import numpy as np, keras, tfmp
built = []
def build():
    built.append(1)
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(2)])
    model.compile("sgd", "mse")
    return model
x, y = np.zeros((8, 4), "float32"), np.zeros((8, 2), "float32")
with tfmp.policy_scope("mixed_bfloat16", verbose=False):  # no compile line: the output is read
    model = build()
model.fit(x, y, epochs=1, verbose=0)  # training itself needs no scipy
try:
    tfmp.compare(build, (x, y), policies=("float32", "mixed_bfloat16"), epochs=1)
except ModuleNotFoundError as error:
    print("RAISED", error.name, len(built))
    print(error)
"""


def _run_without(module, code, tmp_path):
    env = script_env()
    env["PYTHONPATH"] = os.pathsep.join([without_module(tmp_path, module), env["PYTHONPATH"]])
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            timeout=300, env=env, cwd=ROOT)
    assert result.returncode == 0, result.stderr[-3000:]
    return result.stdout.splitlines()


def test_without_scipy_tfmp_trains_and_compare_names_the_extra_before_training(tmp_path):
    lines = _run_without("scipy", COMPARE_WITHOUT_SCIPY, tmp_path)
    # One model built by the script itself, none by compare: it stopped first.
    assert lines[0] == "RAISED scipy 1"
    assert "tfmp.compare needs scipy" in lines[1]
    assert 'pip install "tfmp[compare]"' in lines[1]


@pytest.mark.parametrize("module", ["tensorflow_datasets"])
def test_tfmp_imports_and_enables_without(module, tmp_path):
    code = ("import sys, tfmp\n"
            "decision = tfmp.enable('float32'); tfmp.disable()\n"
            f"print(decision.policy, {module!r} in sys.modules)\n")
    assert _run_without(module, code, tmp_path) == ["float32 False"]
