"""Same script, same machine, same decisions: fresh processes under load decide alike.

Two fresh processes run tests/_decisions.py while another one keeps a core busy
(README's command runs the suite's other tests on the other): each must choose the same "auto" policy with the same reason and make
the same per-model decisions for the same model (every field of its
`tfmp.Attachment`: remapper, GELU, bias gradients, convolutions, the
BatchNormalization kernel, speedups, layer policies, float32 forcing, optimizer), and none may run a timing probe
(the script fails if one runs). The branches other CPUs take are run in-process by
the tests of each decision, with the facts of those CPUs injected (tests/_machines.py).
"""

import subprocess
import sys

from _subproc import results, script_env, started

#: Fresh processes deciding at once; loaders keeping both cores busy meanwhile.
PROCESSES, LOADERS = 2, 1
#: Seconds for all of them to import TensorFlow and decide, under that load.
TIMEOUT_S = 300


def test_fresh_processes_under_load_make_the_same_decisions(tmp_path):
    spin = "import time\nend = time.time() + %d\nwhile time.time() < end: pass" % TIMEOUT_S
    loaders = [subprocess.Popen([sys.executable, "-c", spin], env=script_env()) for _ in range(LOADERS)]
    try:
        with started("_decisions.py", [([], {})] * PROCESSES, tmp_path) as launched:
            found = results(launched, TIMEOUT_S)
    finally:
        for loader in loaders:
            loader.kill()
            loader.wait()
    assert len(found) == PROCESSES
    first = found[0]
    assert first["auto"]["policy"] in ("mixed_bfloat16", "float32")
    assert first["mixed_float16"]["optimizer"] == "LossScaleOptimizer"
    assert "measured" not in first["auto"]["reason"]
    for other in found[1:]:
        assert other == first
