"""The CPU speed probe (advice for `tfmp doctor`): its measurement on this CPU, its rounds, its bounds and its checks."""

import contextlib
import math
import time

import pytest

import tfmp
from tfmp._src.policy import float16_fusion
from tfmp._src.policy import speed_probe as _speed


@pytest.fixture
def counted_steps(monkeypatch):
    """Counts the probe's timed calls (warm-ups included)."""
    calls = []
    real = _speed.time_step

    def counting(*args):
        calls.append(args[0])
        return real(*args)

    monkeypatch.setattr(_speed, "time_step", counting)
    return calls


def test_this_cpu_is_measured_at_each_call_and_nothing_is_kept(counted_steps):
    probe = _speed.measure_rounds(1)
    for dtype in _speed.DTYPES:
        assert math.isfinite(probe.step_ms(dtype)) and probe.step_ms(dtype) > 0
    assert probe.factor("float32") == 1.0
    assert (probe.batch, probe.units) == (128, 256)
    assert all(0 <= n <= 5 for n in probe.repeats) and probe.repeats[0] >= 1
    assert math.isfinite(probe.wall_ms) and probe.wall_ms > 0
    # One untimed warm-up per dtype besides the timed steps.
    measured = len(counted_steps)
    assert measured == 3 + sum(probe.repeats)
    assert tfmp.SpeedProbe is _speed.SpeedProbe
    again = _speed.measure_rounds(1)
    assert again is not probe and len(counted_steps) > measured  # measured again: no cache


class _FakeStep:
    """Stands for a traced step taking `seconds` a call; counts its calls.

    Each takes 1 ms at least, so that scheduling noise (tenths of a millisecond)
    cannot make one step 20x another's.
    """

    def __init__(self, seconds):
        self.seconds, self.calls = seconds, 0

    def get_concrete_function(self, *args):
        return self

    def __call__(self, *args):
        self.calls += 1
        time.sleep(self.seconds)
        return (self,)

    def numpy(self):
        return 0.0


def _fake_probe(monkeypatch, seconds):
    steps = {dtype: _FakeStep(seconds[dtype]) for dtype in _speed.DTYPES}
    monkeypatch.setattr(_speed, "train_step", lambda dtype: steps[dtype])
    return _speed._measure(), steps


def test_a_crawling_dtype_runs_its_warm_up_and_one_timed_step(monkeypatch):
    """float16 0.15 s a step (over the 100 ms budget, far over float32's): one timed step."""
    probe, steps = _fake_probe(monkeypatch, {"float32": 0.001, "bfloat16": 0.001, "float16": 0.15})
    assert probe.repeats == (5, 5, 1)
    assert steps["float16"].calls == 2 and steps["float32"].calls == 6
    assert probe.float16_ms >= 150.0


class _SlowFirstStep(_FakeStep):
    """A step whose first call (the warm-up) takes `first` seconds, the next ones `seconds`."""

    def __init__(self, seconds, first):
        super().__init__(seconds)
        self.first = first

    def __call__(self, *args):
        if self.calls == 0:
            time.sleep(self.first - self.seconds)
        return super().__call__(*args)


def test_a_slow_warm_up_does_not_stand_for_the_step(monkeypatch):
    """A one-time set-up of 0.25 s before 1 ms bfloat16 steps (seen on a Zen 4) reads as 1 ms, not 0.25 s."""
    steps = {"float32": _FakeStep(0.001), "bfloat16": _SlowFirstStep(0.001, first=0.25),
             "float16": _FakeStep(0.001)}
    monkeypatch.setattr(_speed, "train_step", lambda dtype: steps[dtype])
    probe = _speed._measure()
    assert probe.repeats == (5, 5, 5) and steps["bfloat16"].calls == 6
    assert probe.bfloat16_ms < 20.0 and 0.05 < probe.factor("bfloat16") < 20.0


def test_a_far_slower_dtype_stops_after_one_timed_step(monkeypatch):
    """float16 0.07 s a step: its warm-up is within the budget, then one step, far slower."""
    probe, steps = _fake_probe(monkeypatch, {"float32": 0.001, "bfloat16": 0.001, "float16": 0.07})
    assert probe.repeats == (5, 5, 1) and steps["float16"].calls == 2
    assert probe.float16_ms >= 70.0


def test_float16_runs_inside_remapper_off_only_when_asked(monkeypatch):
    """tfmp's own float16 path where the fused kernel is a trap (`float16_fusion.remapper_off`)."""
    inside = []

    @contextlib.contextmanager
    def recording_off():
        inside.append(True)
        yield
        inside.pop()

    class Recording(_FakeStep):
        def __call__(self, *args):
            self.off.append(bool(inside))
            return super().__call__(*args)

    monkeypatch.setattr(float16_fusion, "remapper_off", recording_off)
    for unfused in (True, False):
        steps = {dtype: Recording(0.001) for dtype in _speed.DTYPES}
        for step in steps.values():
            step.off = []
        monkeypatch.setattr(_speed, "train_step", lambda dtype: steps[dtype])
        _speed._measure(float16_unfused=unfused)
        assert set(steps["float16"].off) == {unfused}
        assert set(steps["float32"].off) == set(steps["bfloat16"].off) == {False}


def test_rounds_share_one_trace_of_each_step(monkeypatch):
    """Tracing took 2/3 of three rounds (AMD EPYC Zen 3): the rounds reuse the first one's steps."""
    built = []

    def build(dtype):
        built.append(dtype)
        return _FakeStep(0.001)

    monkeypatch.setattr(_speed, "train_step", build)
    probe = _speed.measure_rounds(3)
    assert sorted(built) == sorted(_speed.DTYPES) and probe.repeats == (15, 15, 15)


def test_each_dtype_stops_at_its_time_budget(monkeypatch):
    """float32 and bfloat16 0.06 s a step: not far slower, but two steps pass the 100 ms budget."""
    probe, _ = _fake_probe(monkeypatch, {"float32": 0.06, "bfloat16": 0.06, "float16": 0.001})
    assert probe.repeats == (2, 2, 5)


def test_factors_come_from_the_step_times():
    probe = tfmp.SpeedProbe(float32_ms=2.0, bfloat16_ms=1.0, float16_ms=100.0)
    assert (probe.factor("float32"), probe.factor("bfloat16"), probe.factor("float16")) == (
        1.0, 2.0, 0.02)
    assert probe.to_dict() == {
        "step_ms": {"float32": 2.0, "bfloat16": 1.0, "float16": 100.0},
        "factor": {"float32": 1.0, "bfloat16": 2.0, "float16": 0.02},
        "batch": 128, "units": 256, "repeats": None, "wall_ms": None, "factor_range": None,
    }
    with_counts = tfmp.SpeedProbe(2.0, 1.0, 100.0, repeats=(5, 4, 1), wall_ms=250.0)
    assert with_counts.to_dict()["repeats"] == {"float32": 5, "bfloat16": 4, "float16": 1}


def test_rounds_report_the_fastest_step_and_the_spread_of_each_factor(monkeypatch):
    rounds = iter([tfmp.SpeedProbe(2.0, 1.0, 100.0, repeats=(5, 5, 1), wall_ms=300.0),
                   tfmp.SpeedProbe(4.0, 1.0, 50.0, repeats=(5, 4, 1), wall_ms=400.0),
                   tfmp.SpeedProbe(2.0, 4.0, 200.0, repeats=(3, 2, 1), wall_ms=500.0)])
    monkeypatch.setattr(_speed, "_measure", lambda float16_unfused, traced: next(rounds))
    probe = _speed.measure_rounds(3)
    assert (probe.float32_ms, probe.bfloat16_ms, probe.float16_ms) == (2.0, 1.0, 50.0)
    assert probe.repeats == (13, 11, 3) and probe.wall_ms == 1200.0
    assert probe.factor_ranges == ((1.0, 1.0), (0.5, 4.0), (0.01, 0.08))
    assert probe.to_dict()["factor_range"]["bfloat16"] == [0.5, 4.0]
    with pytest.raises(ValueError, match=r"Invalid `rounds` argument. Expected an integer >= 1. "
                                         r"Received: rounds=0"):
        _speed.measure_rounds(0)
    with pytest.raises(ValueError, match=r"Invalid `factor_ranges` argument"):
        tfmp.SpeedProbe(1.0, 1.0, 1.0, factor_ranges=((1.0, 1.0), (2.0, 1.0), (1.0, 1.0)))


@pytest.mark.parametrize("factor, text", [
    (2.0, "2.0"), (1.88, "1.9"), (0.5, "0.5"), (0.82, "0.82"), (0.02, "0.02"), (0.0065, "0.0065"),
])
def test_factor_format(factor, text):
    assert _speed.format_factor(factor) == text


@pytest.mark.parametrize("value", [0, -1.0, math.nan, math.inf, "1.5", True, None])
def test_bad_step_times_are_refused_with_the_template(value):
    with pytest.raises(ValueError) as info:
        tfmp.SpeedProbe(float32_ms=1.0, bfloat16_ms=value, float16_ms=1.0)
    assert str(info.value).startswith(
        "Invalid `bfloat16_ms` argument. Expected a positive finite number of milliseconds. "
        f"Received: bfloat16_ms={value!r}")


def test_bad_sizes_and_dtypes_are_refused_with_the_template():
    with pytest.raises(ValueError, match=r"Invalid `units` argument. Expected an integer >= 1. "
                                         r"Received: units=0 \(of type int\)"):
        tfmp.SpeedProbe(1.0, 1.0, 1.0, units=0)
    with pytest.raises(ValueError, match=r"Invalid `repeats` argument. .*Received: repeats=\[5, 5, 5\]"):
        tfmp.SpeedProbe(1.0, 1.0, 1.0, repeats=[5, 5, 5])
    with pytest.raises(ValueError, match=r"Received: dtype='bfloat' .*Did you mean 'bfloat16'\?"):
        tfmp.SpeedProbe(1.0, 1.0, 1.0).factor("bfloat")
