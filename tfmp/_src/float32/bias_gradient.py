"""The bias gradient of a 16-bit Dense or convolution summed with float32 accumulation on a CPU.

TensorFlow's CPU ``BiasAddGrad`` accumulates in bfloat16 and loses large sums; ``Sum``
accumulates in float32. For a model whose attachment says so (`decision`, from the
known-answer `probe` of this process's kernels), the hook on ``add`` keeps Keras's forward
pass and gives the bias ``reduce_sum(dy)``. Measurements: benchmarks/README.md, "Bias gradients".
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Any, Callable, Iterator, List, Optional

from tfmp._src.attachment import record
from tfmp._src.constants import LOW_PRECISION
from tfmp._src.float32 import inside
from tfmp._src.keras_hooks import backend_ops, layer_calls
from tfmp._src.policy.hardware import DeviceFacts
from tfmp._src.policy.probe_cache import ProbeCache

#: ``Attachment.bias_gradient`` of a model whose 16-bit bias gradients tfmp sums.
SUMMED = "summed"
#: ... except after a Conv2D, where oneDNN's fused filter-and-bias gradient kernel keeps the sum.
SUMMED_EXCEPT_CONV2D = "summed except after Conv2D"
#: ``Attachment.bias_gradient`` of a model that keeps Keras's gradient without a check.
KERAS = "keras"
#: The known answer: `ROWS` rows of `VALUE` (rounded to the dtype) in `COLUMNS` columns;
#: the Conv2D check has `ROWS` positions (`CONV_BATCH` images of `CONV_SIDE` squared).
ROWS, COLUMNS, VALUE = 4096, 8, 0.01
CONV_BATCH, CONV_SIDE = 16, 16
#: A sum is lost when off by more than this fraction (four bfloat16 units in the last place).
LOST = 2.0**-6

_probes = ProbeCache()
_cache = _probes.cache


@dataclasses.dataclass(frozen=True)
class BiasGradientProbe:
    """What this process's CPU kernels make of a known bias gradient in one 16-bit dtype.

    Attributes:
        dtype: String. ``"bfloat16"`` or ``"float16"``.
        exact: Float. `ROWS` times `VALUE` rounded to `dtype` (41.0 in bfloat16).
        bias_add_grad: Float. Column 0 of ``BiasAddGrad`` of the `ROWS` x `COLUMNS` gradient.
        summed: Float. Column 0 of ``tf.reduce_sum`` over the rows.
        conv2d: Float. The same ``BiasAddGrad`` traced beside a Conv2D filter's
            gradient, as oneDNN fuses them where it can.
        source: String. ``"measured"``, ``"injected"`` (tests) or ``"failed: <error>"``.
    """

    dtype: str
    exact: float
    bias_add_grad: float
    summed: float
    conv2d: float
    source: str = "measured"

    def _lost(self, value: float) -> bool:
        return not abs(value - self.exact) <= LOST * self.exact  # NaN counts as lost

    @property
    def kernel_loses_it(self) -> bool:
        """Bool. ``BiasAddGrad`` is off by more than `LOST` while the ``Sum`` is not."""
        return self._lost(self.bias_add_grad) and not self._lost(self.summed)

    @property
    def conv2d_loses_it(self) -> bool:
        """Bool. A traced Conv2D's bias gradient is off by more than `LOST`."""
        return self._lost(self.conv2d)

    def describe(self) -> str:
        """String. The figures in one clause, e.g. for ``Attachment.bias_gradient``."""
        if self.source.startswith("failed"):
            return f"the {self.dtype} bias gradient check {self.source}"
        return (f"{ROWS} rows of {VALUE:g} in {self.dtype}: BiasAddGrad {self.bias_add_grad:.4g}, "
                f"Sum {self.summed:.4g}, traced Conv2D {self.conv2d:.4g}, exact {self.exact:.4g} "
                f"({self.source})")


def _conv2d_bias_gradient() -> Any:
    """A `tf.function` ``(x, dy) -> BiasAddGrad(dy)`` beside a 1x1 Conv2D's filter gradient (oneDNN fuses them)."""
    import tensorflow as tf

    @tf.function(autograph=False)
    def gradient(x, dy):
        filter_gradient = tf.raw_ops.Conv2DBackpropFilter(
            input=x, filter_sizes=[1, 1, x.shape[-1], dy.shape[-1]], out_backprop=dy,
            strides=[1, 1, 1, 1], padding="SAME")
        return filter_gradient, tf.raw_ops.BiasAddGrad(out_backprop=dy)

    return gradient


def measure(dtype: str) -> BiasGradientProbe:
    """Runs the known-answer checks in `dtype` now, eagerly (NaN sums, ``source="failed: ..."`` if they cannot run)."""
    import tensorflow as tf

    nan = float("nan")
    with tf.init_scope(), tf.device("/CPU:0"):
        value = tf.constant(VALUE, dtype)
        exact = ROWS * float(tf.cast(value, tf.float64))
        gradient = tf.fill((ROWS, COLUMNS), value)
        try:
            kernel = float(tf.cast(tf.raw_ops.BiasAddGrad(out_backprop=gradient)[0], tf.float64))
            summed = float(tf.cast(tf.reduce_sum(gradient, axis=0)[0], tf.float64))
            _, conv2d = _conv2d_bias_gradient()(tf.ones((CONV_BATCH, CONV_SIDE, CONV_SIDE, 2), dtype),
                                                tf.fill((CONV_BATCH, CONV_SIDE, CONV_SIDE, COLUMNS), value))
            conv2d = float(tf.cast(conv2d[0], tf.float64))
        except tf.errors.OpError as error:
            return BiasGradientProbe(dtype, exact, nan, nan, nan, f"failed: {type(error).__name__}")
    return BiasGradientProbe(dtype, exact, kernel, summed, conv2d)


def probe(dtype: str) -> BiasGradientProbe:
    """This process's `BiasGradientProbe` for `dtype`: the injected one, else measured once and cached."""
    return _probes.get(dtype, measure)


@contextlib.contextmanager
def injected(loses: bool, dtypes: tuple = LOW_PRECISION,
             conv2d_loses: bool = False) -> Iterator[List[BiasGradientProbe]]:
    """Makes `probe` return, for each of `dtypes` inside the block (tests), whether the kernels lose the sum."""
    with _probes.injected(
            BiasGradientProbe(dtype, 41.0, 4.0 if loses else 41.0, 41.0, 4.0 if conv2d_loses else 41.0, "injected")
            for dtype in dtypes) as results:
        yield results


def decision(compute_dtype: str, facts: Optional[DeviceFacts] = None) -> str:
    """``Attachment.bias_gradient`` for `compute_dtype` on this machine (``facts`` None) or one with ``facts``.

    ``"<SUMMED, SUMMED_EXCEPT_CONV2D or KERAS>: <check>"``, or `inside.kept_as_keras`'s text.
    """
    kept = inside.kept_as_keras("bias_gradient", compute_dtype in LOW_PRECISION, facts)
    if kept:
        return kept
    found = probe(compute_dtype)
    if not found.kernel_loses_it:
        return f"{KERAS}: {found.describe()}"
    return f"{SUMMED if found.conv2d_loses_it else SUMMED_EXCEPT_CONV2D}: {found.describe()}"


def channel_axis(x: Any, bias: Any) -> Optional[int]:
    """The axis of `x` Keras's backend ``add`` adds `bias` along with ``tf.nn.bias_add`` (last or second), or None."""
    squeezed = [d for d in bias.shape.as_list() if d is None or d > 1]
    if len(squeezed) != 1 or squeezed[0] is None or len(x.shape) < 2:
        return None
    dims = x.shape.as_list()
    if dims[-1] == squeezed[0]:
        return len(dims) - 1
    return 1 if dims[1] == squeezed[0] else None


def takes_summed_gradient(x: Any, bias: Any, decided: str, layer: Any = None) -> bool:
    """Whether this ``add`` of dense tensors of one 16-bit dtype, `bias` along `channel_axis`, gets `bias_add_summed`.

    Not under `SUMMED_EXCEPT_CONV2D` after a traced Conv2D of `layer` whose filter trains: oneDNN fuses the two.
    """
    import tensorflow as tf

    if not (isinstance(x, tf.Tensor) and isinstance(bias, tf.Tensor)):
        return False
    if x.dtype != bias.dtype or x.dtype.name not in LOW_PRECISION or channel_axis(x, bias) is None:
        return False
    if decided.startswith(SUMMED_EXCEPT_CONV2D):
        from_conv2d = not tf.executing_eagerly() and getattr(getattr(x, "op", None), "type", None) == "Conv2D"
        return not (from_conv2d and _filters_train(layer))
    return decided.startswith(SUMMED)


def _filters_train(layer: Any) -> bool:
    """Bool. `layer` trains and so does each of its weights but the bias (None: True)."""
    if layer is None:
        return True
    bias = getattr(layer, "bias", None)
    return bool(layer.trainable) and all(w.trainable for w in layer.weights if w is not bias)


def bias_add_summed(x: Any, bias: Any, add: Callable) -> Any:
    """``add(x, bias)`` (Keras's ``tf.nn.bias_add``); `bias`'s gradient is ``dy`` summed (float32-accumulated)
    over every axis but the `channel_axis`."""
    import tensorflow as tf

    axis = channel_axis(x, bias)

    @tf.custom_gradient
    def biased(x, bias):
        def grad(dy):
            rows = [a for a in range(len(x.shape)) if a != axis]
            return dy, tf.reshape(tf.reduce_sum(dy, axis=rows), tf.shape(bias))

        return add(x, bias), grad

    return biased(x, bias)


def _replace(call: backend_ops.OpCall) -> Any:
    import tensorflow as tf

    x1, x2 = call.inputs
    # Cheap tests first: every keras.ops.add of any model passes here while hooked.
    if isinstance(x1, tf.Tensor) and x1.dtype.name in LOW_PRECISION:  # not a SparseTensor
        layer = layer_calls.calling_layer()
        attached = record.of_calling(layer)
        decided = attached.bias_gradient if attached is not None else KERAS
        if decided.startswith(SUMMED):
            import keras

            bias = x2.value if isinstance(x2, keras.Variable) else x2  # its autocast value
            if takes_summed_gradient(x1, bias, decided, layer):
                return bias_add_summed(x1, bias, call.keras)
    return backend_ops.KERAS


def install() -> backend_ops.Hook:
    """Hooks Keras's TensorFlow backend ``add``; ``.remove()`` the returned `Hook` to undo."""
    return backend_ops.subscribe("add", _replace, owner="bias_gradient")
