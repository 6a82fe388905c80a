"""Every tfmp warning, and the opening of tfmp's longer errors, is three short lines and the guide's link.

The form is `tfmp._src.errors.opening` (what happened, the cause in this model, the fix, then
``Guide: <troubleshooting.md>#<section>``). Two checks: a static one over tfmp's source (every warning
goes through `errors.warn`, every section named exists in the shipped guide, no line of literal text is
long or quotes another machine), and a table that makes each warning and error text cheaply (tiny models,
or the functions that build the text called with injected facts) and reads it.
"""

import ast
import errno
import os
import pathlib
import re
import types
import warnings

import keras
import numpy as np
import pytest
from _machines import SAPPHIRE_RAPIDS, XEON_NO_BF16

import tfmp
from tfmp._src import errors
from tfmp._src.constants import TROUBLESHOOTING_GUIDE
from tfmp._src.deployment import quantize_hint, tflite_hint
from tfmp._src.float32 import dtype_errors, gradient_errors, master_weights, unsafe_ops, xla_bilinear
from tfmp._src.keras_hooks import availability
from tfmp._src.loss_scale import custom_optimizers, guard, loops, user_settings
from tfmp._src.monitor import event_file
from tfmp._src.numerics import record, report, terms
from tfmp._src.policy import enable as enable_module
from tfmp._src.policy.hardware import detect_device_facts, injected_facts
from tfmp._src.policy.policy import resolve_policy

ROOT = pathlib.Path(__file__).resolve().parents[1]
SOURCE = ROOT / "tfmp"
#: Names of CPUs and GPUs: a message may name only the machine it runs on (its detected facts).
MACHINES = re.compile(r"Zen ?\d|Sapphire|Xeon|EPYC|Cascade Lake|Ice Lake|Skylake|Graviton|Neoverse|"
                      r"A100|H100|V100|\bT4\b|TPU v\d", re.IGNORECASE)
#: A timing or a speed ratio: "17,027 ms", "240x float32's", "100-500x slower", "2.0-2.6x faster".
TIMING = re.compile(r"\d[\d,.]*\s*(ms|seconds)\b|\d[\d.]*(-\d[\d.]*)?x (slower|faster|float32)")
#: The characters a formatted field (a model name, a layer path, a dtype) counts for in the static check.
FIELD = 10


#: The error TensorFlow 2.21's TFLite converter raised for a bfloat16 Dense model (its first and last lines).
CONVERTER_ERROR = (
    'Could not translate MLIR to FlatBuffer.<unknown>:0: error: loc(callsite(fused["MatMul:", '
    '"sequential_1/dense_1/MatMul@__inference_function_74"] at callsite(fused["StatefulPartitionedCall:", '
    '"StatefulPartitionedCall@__inference_signature_wrapper_93"] at fused["StatefulPartitionedCall:", '
    '"StatefulPartitionedCall_1"]))): \'tf.MatMul\' op is neither a custom op nor a flex op\n'
    "\ttf.MatMul(tensor<?x4xbf16>, tensor<2x4xbf16>) -> (tensor<?x2xbf16>) : {transpose_b = true}\n")


def _slug(heading):
    """The anchor Python-Markdown's toc extension gives a heading (its default `slugify`)."""
    text = re.sub(r"[^\w\s-]", "", heading).strip().lower()
    return re.sub(r"[-\s]+", "-", text)


SECTIONS = {_slug(line[3:]) for line in pathlib.Path(TROUBLESHOOTING_GUIDE).read_text().splitlines()
            if line.startswith("## ")}


def _calls(tree, name):
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            func = node.func
            called = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", None)
            if called == name:
                yield node


def _literal_length(node):
    """Characters of a string argument with each formatted field counted as `FIELD`; None if not literal."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return len(node.value)
    if isinstance(node, ast.JoinedStr):
        return sum(len(part.value) if isinstance(part, ast.Constant) else FIELD for part in node.values)
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add):
        left, right = _literal_length(node.left), _literal_length(node.right)
        return None if left is None or right is None else left + right
    return None


def _literal_text(node):
    return " ".join(part.value for part in ast.walk(node)
                    if isinstance(part, ast.Constant) and isinstance(part.value, str))


def _sources():
    for path in sorted(SOURCE.rglob("*.py")):
        yield path, ast.parse(path.read_text(), str(path))


def test_every_warning_goes_through_errors_warn_with_a_guide_section_and_short_literal_lines():
    direct, sections, long_lines, foreign = [], set(), [], []
    for path, tree in _sources():
        where = path.relative_to(ROOT)
        if path.name != "errors.py" or path.parent.name != "_src":
            direct += [f"{where}:{call.lineno}" for call in _calls(tree, "warn")
                       if isinstance(call.func, ast.Attribute) and getattr(call.func.value, "id", "") == "warnings"]
        for name, count in (("warn", 3), ("opening", 3)):
            for call in _calls(tree, name):
                if isinstance(call.func, ast.Attribute):
                    continue  # warnings.warn, counted above
                keywords = {k.arg: k.value for k in call.keywords}
                section = keywords.get("section", call.args[3] if name == "opening" and len(call.args) > 3 else None)
                if isinstance(section, ast.Constant):
                    sections.add((section.value, f"{where}:{call.lineno}"))
                lines = call.args[:count] if not isinstance(call.args[0], ast.Starred) else []
                for line in lines:
                    length = _literal_length(line)
                    if length is not None and length > errors.LINE_LENGTH:
                        long_lines.append(f"{where}:{line.lineno} ({length})")
                    text = _literal_text(line)
                    if MACHINES.search(text) or TIMING.search(text):
                        foreign.append(f"{where}:{line.lineno}: {text[:80]}")
    assert direct == []  # e.g. a new `warnings.warn(...)`: use tfmp._src.errors.warn
    assert len(sections) >= 20 and {s for s, _ in sections} <= SECTIONS, sorted(
        (s, w) for s, w in sections if s not in SECTIONS)
    assert long_lines == [] and foreign == [], (long_lines, foreign)


def _check(text, machine_names=()):
    """Asserts `text`'s opening: <= 3 lines, each <= LINE_LENGTH, then the guide line naming an existing
    section; no other machine's name, no timing. Returns the opening's lines."""
    lines = text.splitlines()
    guide = next(i for i, line in enumerate(lines) if line.startswith(errors.GUIDE_PREFIX))
    opening, link = lines[:guide], lines[guide][len(errors.GUIDE_PREFIX):]
    assert 1 <= len(opening) <= errors.OPENING_LINES, text
    assert all(len(line) <= errors.LINE_LENGTH for line in opening), [len(line) for line in opening]
    path, _, section = link.partition("#")
    assert path == TROUBLESHOOTING_GUIDE and os.path.exists(path) and section in SECTIONS, link
    said = "\n".join(opening)
    for name in machine_names:
        said = said.replace(name, "")
    assert not MACHINES.search(said) and not TIMING.search(said), said
    return opening


def _warned(call, *args, **kwargs):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        call(*args, **kwargs)
    return [(w.category, str(w.message)) for w in caught]


def _tiny(name="net"):
    return keras.Sequential([keras.Input((4,)), keras.layers.Dense(2, name="proj"),
                             keras.layers.Softmax(name="softmax")], name=name)


def test_each_warning_and_error_opening_is_three_short_lines_and_the_guide(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # folders named as users name them: "logs"
    said = []  # (category, text, names of the machine the text may quote)
    with injected_facts(XEON_NO_BF16):  # both 16-bit policies slower than float32: a warning each, on any CPU
        for policy in ("mixed_float16", "mixed_bfloat16"):
            said += [(c, t, (XEON_NO_BF16.cpu_name,)) for c, t in _warned(resolve_policy, policy)]
    with injected_facts(SAPPHIRE_RAPIDS):  # the float16 remapper trap: names only this (injected) CPU
        said += [(c, t, (SAPPHIRE_RAPIDS.cpu_name,)) for c, t in _warned(resolve_policy, "mixed_float16")]
    onednn_off = tfmp.DeviceFacts(cpu_name="Intel Xeon Platinum 8480+", cpu_flags=frozenset({"avx512_bf16"}),
                                  system="Darwin")  # bfloat16 flags, oneDNN off (TensorFlow's default there)
    said += [(c, t, (onednn_off.cpu_name,)) for c, t in _warned(resolve_policy, "mixed_bfloat16",
                                                                 device_facts=onednn_off)]
    assert len(said) == 4 and all(c is tfmp.PerformanceWarning for c, _, _ in said)
    assert "Fix: set TF_ENABLE_ONEDNN_OPTS=1 before TensorFlow starts" in said[-1][1]
    # Loss scaling: custom loops, Keras's optimizer replaced, unused options.
    net = types.SimpleNamespace(name="net")
    said += [(c, t, ()) for c, t in _warned(custom_optimizers._warn_container, net, "optimizers", "float16")]
    said += [(c, t, ()) for c, t in _warned(custom_optimizers._warn_unscaled, None, "net", "gen_optimizer")]
    optimizer = types.SimpleNamespace(loss_scaling=True, loss_scale=32768.0, name="lso")
    said += [(c, t, ()) for c, t in _warned(guard.warn_if_unscaled, optimizer,
                                             types.SimpleNamespace(ever=False, warned=False), False)]
    keras_lso = keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD())
    options = dict(user_settings.keras_settings(keras_lso), loss_scaling=False)
    said += [(c, t, ()) for c, t in _warned(user_settings.warn_keras_optimizer_replaced, keras_lso, options,
                                             "bfloat16")]
    said += [(c, t, ()) for c, t in _warned(user_settings.warn_unused_scaling_options, {"initial_scale": 8.0},
                                             "mixed_bfloat16", "bfloat16")]
    # Policy and build order, a loaded model, unmatched targets, 16-bit variables, bilinear resizes under XLA.
    for scoped in (False, True):
        state = types.SimpleNamespace(decision=types.SimpleNamespace(policy="mixed_bfloat16"),
                                      previous_policy=keras.DTypePolicy("float32"), scoped=scoped)
        said += [(c, t, ()) for c, t in _warned(enable_module._warn_replaced, state,
                                                 types.SimpleNamespace(policy="float32"))]
    said += [(c, t, ()) for c, t in _warned(enable_module._warn_if_built_before_enable, _tiny(), "mixed_bfloat16")]
    said += [(c, t, ()) for c, t in _warned(enable_module._warn_loaded_under_another_policy, net,
                                             "mixed_float16", "mixed_bfloat16")]
    said += [(c, t, ()) for c, t in _warned(tfmp.force_float32, _tiny(), exclude=["*softmx"])]
    weight = keras.Variable(np.ones(2), dtype="bfloat16", name="gain")
    said += [(c, t, ()) for c, t in _warned(master_weights._warn, "Model 'net' (mixed_bfloat16)",
                                             "Its SGD (not a tfmp.LossScaleOptimizer) keeps no float32 copies: ",
                                             [("scale/gain", weight)])]
    keras.config.set_dtype_policy("mixed_bfloat16")  # restored by conftest
    resizing = keras.Sequential([keras.Input((4, 4, 1)), keras.layers.UpSampling2D(interpolation="bilinear",
                                                                                     name="up")], name="net")
    resizing.jit_compile = True
    said += [(c, t, ()) for c, t in _warned(xla_bilinear.turn_off_xla_for_bilinear, resizing)]
    # A feature switched off, a data set without floats, TensorBoard folders shared and failing.
    try:
        said += [(c, t, ()) for c, t in _warned(availability.switch_off, "first_step", AttributeError("moved"))]
    finally:
        availability.clear()
    said += [(c, t, ()) for c, t in _warned(tfmp.check_dataset, np.ones((4, 2), "int32"))]
    os.mkdir("logs")
    open("logs/events.out.tfevents.1.otherhost.99999.0.v2", "w").close()
    said += [(c, t, ()) for c, t in _warned(event_file._warn_if_shared, "logs")]
    writer = event_file.EventFile("full")
    said += [(c, t, ()) for c, t in _warned(writer._fail, 3, OSError(errno.ENOSPC, "No space left on device"))]
    writer.close()
    assert len(said) == 20, [t for _, t, _ in said]
    # Errors: the stuck run's and the skips' causes, a dtype mismatch at build and at compile.
    for status in (32, 4, 1, 16, 0):
        for scaling in (True, False):
            _, _, why, fix = loops.cause(status, scaling)
            said.append((tfmp.NonFiniteError, errors.opening(
                "Training is stuck: 20 non-finite steps in a row (max_consecutive_overflows=20); last skipped "
                "step 41, loss scale 1.", why, fix, "nan-or-inf-loss"), ()))
    for at_build in (True, False):
        text = dtype_errors.explanation("block/attention", keras.layers.Dense(2), "bfloat16", "float32",
                                        at_build=at_build)
        said.append((TypeError, text, ()))
    # A backward-pass mismatch (in the layer, where a wrong gradient arrives, from output_gradients), an
    # excluded layer's 16-bit linalg, a TFLite conversion and an int8 quantization of a 16-bit model.
    for kwargs in ({}, {"received": True}, {"output_gradient": ("bfloat16", "float32")}):
        said.append((TypeError, gradient_errors.explanation("block/scaled", keras.layers.Dense(2), "bfloat16",
                                                            "float32", **kwargs), ()))
    said.append((TypeError, unsafe_ops.excluded_message(keras.layers.Dense(2, name="lin"),
                                                        ("Cholesky", "MatrixInverse"), "bfloat16"), ()))
    assert "runs Cholesky, MatrixInverse on bfloat16 inputs" in said[-1][1].splitlines()[0]
    said.append((Exception, tflite_hint.hint(CONVERTER_ERROR), ()))
    float16_model = types.SimpleNamespace(name="net", dtype_policy=keras.DTypePolicy("mixed_float16"))
    said.append((ValueError, quantize_hint.hint(float16_model, "int8"), ()))
    assert "in bfloat16 (first in the ops of 'sequential_1/dense_1')." in said[-2][1].splitlines()[0]
    # check_numerics' errors: each forward case and each loss term, built from injected trace rows.
    row = {"layer": "block/dense", "layer_class": "Dense", "kind": "inf", "input_kind": None,
           "input_range": (-3.0, 70000.0), "dtype": "float16"}
    rows = [row, dict(row, input_kind="nan"), dict(row, kind=None), dict(row, layer=record.LOSS_ENTRY),
            dict(row, dtype="bfloat16", input_range=None)]
    hint = "its float16 logsumexp over 76,800 values can exceed 65504: tfmp.register_float32('block/dense')."
    lines = [report._forward_message(item, "inf", 3, None) for item in rows] + [
        report._forward_message(row, "inf", 3, hint)] + [
        report._forward_message(row, "inf", 3, found.advice("block/dense"))  # a 16-bit constant or linalg op
        for found in (unsafe_ops.UnsafeOps("float16", constants=("-1e+09",)),
                      unsafe_ops.UnsafeOps("float16", ("Cholesky", "MatrixInverse")))]
    for kind in (terms.WEIGHT, terms.ACTIVITY, terms.ADD_LOSS, terms.ADD_LOSS_OR_ACTIVITY, "position"):
        term = types.SimpleNamespace(kind=kind, regularizer="L2(l2=1e+38)", variable="kernel", position=2)
        for dtype in ("float16", "float32"):
            lines.append(terms.term_message(dict(row, term=term, dtype=dtype), "inf", 3, "net"))
    said += [(tfmp.NonFiniteError, errors.opening(*three, "nan-or-inf-loss", details="Trace (...):"), ())
             for three in lines]
    for _, text, names in said:
        _check(text, names)


def test_a_non_finite_error_opens_with_three_lines_and_keeps_its_trace_below():
    model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(2, name="dense"),
                              keras.layers.Lambda(lambda x: 1.0 / (x * 0.0), name="divide")], name="net")
    tfmp.check_numerics(model)
    model.compile("sgd", "mse")
    with pytest.raises(tfmp.NonFiniteError) as info:
        model.fit(np.ones((4, 2)), np.ones((4, 2)), verbose=0)
    opening = _check(str(info.value))
    assert opening[0].startswith("Layer 'divide' (Lambda) is the first checked layer to see ")
    assert opening[0].endswith("at train step 0.")
    assert str(info.value).split("\nGuide: ")[1].splitlines()[1].startswith("Trace (")


def test_the_float16_cpu_warning_is_short_and_the_decision_does_not_print_it_again():
    with injected_facts(SAPPHIRE_RAPIDS), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        decision = resolve_policy("mixed_float16")
    [text] = [str(w.message) for w in caught]
    assert len(text) < 500  # it was about 1,100 characters, quoting another machine's timings
    assert text.splitlines()[0].endswith("; tfmp trains it without Grappler's slow fused float16 MatMul.")
    assert "fused" not in str(decision) and "Guide" not in str(decision)


@pytest.mark.filterwarnings("ignore::tfmp.PerformanceWarning")  # bfloat16 on a CPU without its flags
def test_a_model_that_never_builds_is_offered_only_fixes_that_act_before_compile():
    """keras.io's Swin Transformer: its attention adds a mask it casts to float32 onto 16-bit scores."""

    class WindowAttention(keras.layers.Layer):
        def call(self, scores):
            mask = keras.ops.cast(keras.ops.ones_like(scores) > 0, "float32")  # the user's own cast
            return scores + mask * -100.0

    with tfmp.policy_scope("mixed_bfloat16"), pytest.raises(Exception) as caught:
        inputs = keras.Input((4, 4))
        keras.Model(inputs, WindowAttention(name="attention")(keras.layers.Dense(4)(inputs)))
    text = re.sub(r"\x1b\[[0-9;]*m", "", str(caught.value))  # Keras's colours
    tfmp_lines = text[text.index("tfmp: "):].splitlines()
    _check("\n".join(tfmp_lines))
    assert tfmp_lines[0].startswith("tfmp: Layer 'attention' (WindowAttention) mixes bfloat16 and float32")
    assert "a cast to float32" in tfmp_lines[1]  # the cause in this model comes first
    assert 'create WindowAttention with dtype="float32"' in tfmp_lines[2]
    assert "keep_float32" not in text and "register_float32" not in text  # they act at compile
