"""The public API is frozen: additions and removals are deliberate."""

import tfmp

PUBLIC_API = {
    "CompareReport",
    "DeviceFacts",
    "DoctorReport",
    "GpuFacts",
    "LossScaleMonitor",
    "LossScaleOptimizer",
    "MemoryEstimate",
    "NonFiniteError",
    "PerformanceWarning",
    "PolicyDecision",
    "__version__",
    "audit",
    "check_dataset",
    "check_numerics",
    "compare",
    "disable",
    "doctor",
    "enable",
    "estimate_kv_cache",
    "estimate_memory",
    "export",
    "float32_layers",
    "force_float32",
    "policy_scope",
    "recommend_policy",
    "register_float32",
    "scaled_gradients",
    "to_float32",
    "unregister_float32",
}


def test_public_api_is_frozen():
    assert set(tfmp.__all__) == PUBLIC_API
    for name in tfmp.__all__:
        assert getattr(tfmp, name) is not None


def test_non_finite_error_is_a_floating_point_error():
    assert issubclass(tfmp.NonFiniteError, FloatingPointError)
    error = tfmp.NonFiniteError("bad", layer="model/dense", phase="forward", step=3, kind="nan")
    assert (error.layer, error.phase, error.step, error.kind) == ("model/dense", "forward", 3, "nan")


def test_version_single_source():
    import configparser
    import pathlib

    cfg = configparser.ConfigParser()
    cfg.read(pathlib.Path(__file__).resolve().parents[1] / "setup.cfg")
    assert cfg["metadata"]["version"] == "attr: tfmp._version.__version__"
    assert tfmp.__version__.count(".") == 2
