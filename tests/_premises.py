"""What TensorFlow itself does on the machine the tests run on, by the rules tfmp uses.

A test of what tfmp decides injects the machine it needs (`_machines`) and passes
on any CPU. A test that observes TensorFlow's own kernels or graphs (which kernel
refuses, which ops Grappler fuses, which sum a kernel loses) reads its expectation
here, from this machine's real facts (never injected ones) through tfmp's rules
(`tfmp._src.policy.hardware`), or skips naming the premise that does not hold
here. `tests/test_hardware.py` checks the oneDNN rule against TensorFlow's own
answer, and each premise below has a test against the real kernels.
"""

from typing import Optional

import pytest
from _xla import xla_tier

from tfmp import DeviceFacts
from tfmp._src.keras_hooks import versions
from tfmp._src.policy import hardware


def this_machine() -> DeviceFacts:
    """`DeviceFacts` of the machine the tests run on, whatever a test injected."""
    return hardware._read_device_facts()


#: The first Keras whose TensorFlow backend compiles a ``channels_first`` convolution
#: with XLA on a machine with CPUs only (``keras/src/backend/tensorflow/ops/nn.py``,
#: ``conv``: "Channels first ... are broken on CPU without XLA").
KERAS_CHANNELS_FIRST_XLA = "3.16"


def channels_first_conv_trains(dtype: str, facts: Optional[DeviceFacts] = None) -> bool:
    """Whether plain Keras trains a ``channels_first`` Conv2D computing in `dtype` on a CPU.

    Where Keras compiles it with XLA (`KERAS_CHANNELS_FIRST_XLA` and newer, or a step
    compiled with XLA in the XLA tier) it does. Otherwise TensorFlow's CPU kernels
    decide: only oneDNN's train it (Eigen's ``Conv2D`` and
    ``Conv2DCustomBackpropFilterOp`` take NHWC only), and oneDNN takes float16 only
    where `DeviceFacts.onednn_float16`.
    """
    if versions.keras_at_least(KERAS_CHANNELS_FIRST_XLA) or xla_tier():
        return True
    facts = facts or this_machine()
    return facts.onednn and (dtype != "float16" or facts.onednn_float16)


def conv2d_bias_gradient_is_fused() -> bool:
    """Whether a traced bfloat16 Conv2D's bias gradient comes out of oneDNN's fused
    filter-and-bias kernel (float32 accumulation): where oneDNN takes bfloat16."""
    return this_machine().onednn_bfloat16


def require(premise: bool, what: str) -> None:
    """Skips the calling test where `premise` does not hold here; `what` names it."""
    if not premise:
        pytest.skip(f"premise does not hold on this machine ({this_machine().cpu_name}): {what}")
