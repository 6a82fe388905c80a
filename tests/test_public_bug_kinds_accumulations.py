"""Issue 53 items 1, 3 and 8 (RoPE): 16-bit running sums, MoE routing and positions.

Each kind against a float32 reference beside plain Keras: plain Keras under the
16-bit policy gets it wrong without a word (shown first, so the case stays a real
one); tfmp computes it in float32 by the rule of `tfmp/_src/float32/reductions.py`
(reason in `tfmp.audit`, switched off by an exclusion). The last tests pin the
rule's edges: int ranges and short running sums are left alone.

Expected values come from arithmetic where they can: the running mean of a
constant 1.005 is 1.005, the sum of 1,016 ones is 1,016, integer positions are
distinct. bfloat16 keeps 8 significant bits: it counts whole numbers exactly only
up to 256, and a value near 1 handed back in bfloat16 is within 2**-8 of float32's.
"""

import keras
import numpy as np
import pytest
from keras import ops

import tfmp

T = 2048
BFLOAT16_HALF_STEP_AT_1 = 2.0**-8


class RunningMean(keras.layers.Layer):
    """The mean of the first t steps at each step t: cumsum over time / t (t a constant)."""

    def call(self, x):
        counts = np.arange(1, x.shape[1] + 1, dtype="float32").reshape(1, -1, 1)
        return ops.cumsum(x, axis=1) / ops.cast(counts, x.dtype)


class NodeSum(keras.layers.Layer):
    """A graph readout: every node's features summed into segment 0 (nodes on the batch axis)."""

    def call(self, x):
        return ops.segment_sum(x, ops.zeros((ops.shape(x)[0],), "int32"), num_segments=1)


class MoE(keras.layers.Layer):
    """A router Dense, the top 2 of its 8 logits, 8 expert Dense layers mixed by the softmaxed gates."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.router = keras.layers.Dense(8, name="router")
        self.experts = [keras.layers.Dense(16, name=f"expert_{i}") for i in range(8)]

    def call(self, x, return_routing=False):
        gates, chosen = ops.top_k(self.router(x), k=2)
        if return_routing:
            return chosen
        gates = ops.softmax(gates)
        out = 0
        for e, expert in enumerate(self.experts):
            out = out + ops.sum(ops.where(ops.equal(chosen, e), gates, 0.0), -1, keepdims=True) * expert(x)
        return out


class RoPE(keras.layers.Layer):
    """Rotary position embedding, positions made in the compute dtype (a range, or an int range cast)."""

    def __init__(self, cast_int_range=False, **kwargs):
        super().__init__(**kwargs)
        self.cast_int_range = cast_int_range

    def call(self, x):
        length, dim = x.shape[1], x.shape[2]
        positions = (ops.cast(ops.arange(length), self.compute_dtype) if self.cast_int_range
                     else ops.arange(length, dtype=self.compute_dtype))
        inv_freq = ops.cast(1.0 / 10000 ** (np.arange(0, dim, 2, dtype="float32") / dim), self.compute_dtype)
        angles = positions[:, None] * inv_freq[None, :]
        cos, sin = ops.concatenate([ops.cos(angles)] * 2, -1), ops.concatenate([ops.sin(angles)] * 2, -1)
        rotated = ops.concatenate([-x[..., dim // 2:], x[..., :dim // 2]], axis=-1)
        return x * cos[None] + rotated * sin[None]


def _head(width):
    return keras.layers.Dense(width, name="head", kernel_initializer="identity", bias_initializer="zeros")


def _model(inner, shape, width):
    inputs = keras.Input(shape)
    return keras.Model(inputs, _head(width)(inner(inputs)))


def running_mean_model():
    return _model(RunningMean(name="running_mean"), (T, 1), 1)


def node_sum_model():
    return _model(NodeSum(name="node_sum"), (1,), 1)


def moe_model():
    keras.utils.set_random_seed(0)
    return _model(MoE(name="moe"), (16,), 16)


def rope_model(cast_int_range=False, length=T):
    return _model(RoPE(cast_int_range, name="rope"), (length, 8), 8)


def _plain(policy, build):
    """`build()` under plain Keras and `policy` (restored by conftest)."""
    keras.config.set_dtype_policy(policy)
    model = build()
    keras.config.set_dtype_policy("float32")
    return model


def _with_tfmp(policy, build, weights=None):
    """`build()` compiled under `tfmp.enable(policy)`, with `weights`; tfmp disabled again."""
    try:
        tfmp.enable(policy, verbose=False)
        model = build()
        model.compile("sgd", "mse")
    finally:
        tfmp.disable()
    if weights is not None:
        model.set_weights(weights)
    return model


def _why(model):
    return {row.path: row.why for row in tfmp.audit(model).rows if row.why}


def _last_mean(model):
    return float(np.asarray(model(np.full((1, T, 1), 1.005, "float32")))[0, -1, 0])


@pytest.mark.filterwarnings("ignore::tfmp.PerformanceWarning")
def test_a_bfloat16_running_mean_at_t_2048_reads_1_005():
    """Item 1: a bfloat16 cumsum of 1.005s stalls at 256 (bfloat16's last exact count), so
    the running mean at t=2048 reads about 0.25; tfmp computes the layer in float32."""
    assert abs(_last_mean(_plain("mixed_bfloat16", running_mean_model)) - 1.005) > 0.5
    model = _with_tfmp("mixed_bfloat16", running_mean_model)
    assert _last_mean(model) == pytest.approx(1.005, abs=BFLOAT16_HALF_STEP_AT_1)
    assert _why(model) == {"running_mean": "bfloat16 reduction: cumsum over 2,048 values", "head": "output"}


@pytest.mark.filterwarnings("ignore::tfmp.PerformanceWarning")
@pytest.mark.parametrize("policy", ["mixed_bfloat16", "mixed_float16"])
def test_a_graph_node_sum_over_1016_nodes_reads_1016(policy):
    """Item 1: a segment_sum over an unknown number of nodes (the batch axis) is forced under
    both 16-bit dtypes; bfloat16's stalls at 256 in plain Keras. 1,016 = 127 * 8 is exact in
    bfloat16, so tfmp's handed-back result is exactly float32's."""
    nodes = np.ones((1016, 1), "float32")
    plain = float(np.asarray(_plain(policy, node_sum_model)(nodes))[0, 0])
    if policy == "mixed_bfloat16":
        assert plain < 1016 - 500
    model = _with_tfmp(policy, node_sum_model)
    assert float(np.asarray(model(nodes))[0, 0]) == 1016.0
    low = policy.split("_")[1]
    assert _why(model)["node_sum"] == f"{low} reduction: unsorted_segment_sum over an unknown number of values"


def _routing(model, tokens):
    return np.sort(np.asarray(model.get_layer("moe")(tokens, return_routing=True)), axis=-1)


@pytest.mark.filterwarnings("ignore::tfmp.PerformanceWarning")
@pytest.mark.parametrize("policy", ["mixed_bfloat16", "mixed_float16"])
def test_moe_routing_of_4096_tokens_matches_float32(policy):
    """Item 3: top_k over 16-bit router logits sends some of 4,096 tokens (seed 0) to
    another expert pair than float32 (near-ties rounded together). tfmp forces the MoE
    block and, of its sublayers, only the router making the ranked logits: the experts
    compute in 16 bits (handing float32 back to the block), the block hands back 16 bits."""
    tokens = np.random.default_rng(0).normal(size=(4096, 16)).astype("float32")
    reference = _plain("float32", moe_model)
    expected, expected_out = _routing(reference, tokens), np.asarray(reference(tokens))
    plain = _plain(policy, moe_model)
    plain.set_weights(reference.get_weights())
    assert (_routing(plain, tokens) != expected).any(axis=-1).sum() > 0
    model = _with_tfmp(policy, moe_model, reference.get_weights())
    assert (_routing(model, tokens) != expected).any(axis=-1).sum() == 0
    low = policy.split("_")[1]
    rows = {r.path: (r.compute_dtype, r.output_dtype, r.why) for r in tfmp.audit(model).rows}
    assert rows["moe"] == ("float32", low, f"{low} ranking: top_k over 8 values made by 'router'")
    assert rows["moe/router"] == ("float32", "float32", "inside moe")
    assert {rows[f"moe/expert_{i}"] for i in range(8)} == {(low, "float32", "")}
    # the whole forward runs on the mixed dtypes, close to float32 (plain Keras: off by > 1 where routes differ)
    np.testing.assert_allclose(np.asarray(model(tokens), "float32"), expected_out, atol=0.1)


def _collisions(model, length=T):
    rows = np.asarray(model(np.ones((1, length, 8), "float32")), "float32")[0]
    _, inverse, counts = np.unique(rows, axis=0, return_inverse=True, return_counts=True)
    return int((counts[inverse.ravel()] > 1).sum())


@pytest.mark.parametrize("cast_int_range", [False, True])
def test_rope_positions_past_256_stay_distinct_under_bfloat16(cast_int_range):
    """Item 8 (RoPE): positions made in bfloat16 (an arange in the compute dtype, or an int
    arange cast to it) round together above 256, so rows of distinct positions collide;
    tfmp computes the RoPE layer in float32: no two rows alike, as in float32."""
    build = lambda: rope_model(cast_int_range)  # noqa: E731
    assert _collisions(_plain("float32", build)) == 0
    assert _collisions(_plain("mixed_bfloat16", build)) > 1000
    model = _with_tfmp("mixed_bfloat16", build)
    assert _collisions(model) == 0
    assert _why(model)["rope"] == "bfloat16 positions: range up to 2,047"


@pytest.mark.filterwarnings("ignore::tfmp.PerformanceWarning")
def test_rope_positions_past_2048_stay_distinct_under_float16():
    """float16 counts exactly up to 2,048: an int range of 4,096 positions cast to float16 collides
    in plain Keras (the float16 arange itself has no TensorFlow kernel); tfmp forces the layer."""
    build = lambda: rope_model(True, 4096)  # noqa: E731
    assert _collisions(_plain("mixed_float16", build), 4096) > 1000
    model = _with_tfmp("mixed_float16", build)
    assert _collisions(model, 4096) == 0
    assert _why(model)["rope"] == "float16 positions: range up to 4,095"


def test_audit_of_plain_keras_says_the_cause_and_the_fix():
    """Under plain Keras, `tfmp.audit` warns with the op, its width, the exact range and the fixes."""
    report = tfmp.audit(_plain("mixed_bfloat16", running_mean_model))
    [warning] = [w for w in report.warnings if w.path == "running_mean"]
    assert warning.kind == "sensitive_16bit"
    assert warning.message == (
        "'running_mean' (RunningMean) computes in bfloat16; its bfloat16 cumsum over 2,048 values stalls "
        "(bfloat16 holds whole numbers exactly only up to 256: a running sum of values of magnitude 1 "
        "stops growing there). Compute it in float32: tfmp.force_float32(model) (the layer not excluded) "
        "or tfmp.register_float32('running_mean'), or cast its input to float32 before accumulating.")


def test_an_exclusion_switches_the_rule_off():
    """`tfmp.register_float32(..., exclude=True)` keeps the layer in bfloat16: plain Keras's value."""
    with tfmp.register_float32("running_mean", exclude=True):
        model = _with_tfmp("mixed_bfloat16", running_mean_model)
    assert _why(model) == {"head": "output"}
    assert abs(_last_mean(model) - 1.005) > 0.5


class IndexedOnly(keras.layers.Layer):
    """Int positions used as indices only, a 16-bit cumsum over 256 values, positions 0..256 cast to 16 bits."""

    def call(self, x):
        picked = ops.take(x, ops.arange(x.shape[1] - 1, -1, -1), axis=1)  # an int range: reversed time
        short = ops.cumsum(x[:, :256], axis=1)
        ramp = ops.cast(ops.arange(257), self.compute_dtype)[None, :256, None]
        return picked[:, :256] + short + ramp


@pytest.mark.parametrize("policy", ["mixed_bfloat16", "mixed_float16"])
def test_int_ranges_and_exactly_counted_sums_are_not_forced(policy):
    """Not flagged: an int range used for indices, a 16-bit cumsum over 256 values (bfloat16
    counts exactly to 256), positions up to 256 cast to 16 bits; under float16 also a cumsum
    over 2,048 values (float16 counts exactly to 2,048)."""
    def build():
        inputs = keras.Input((T, 1))
        x = IndexedOnly(name="indexed")(inputs)
        if policy == "mixed_float16":
            long = keras.layers.Lambda(lambda v: ops.cumsum(v, axis=1)[:, :256], name="cumsum_2048")
            x = keras.layers.Add()([x, long(inputs)])
        return keras.Model(inputs, _head(1)(x))

    model = _plain(policy, build)
    assert {layer.compute_dtype for layer in model.layers[1:-1]} == {policy.split("_")[1]}
    assert [w.path for w in tfmp.audit(model).warnings if w.kind == "sensitive_16bit"] == []


class HandDropout(keras.layers.Layer):
    """Dropout written by hand: a uniform draw in the compute dtype compared with the rate."""

    def __init__(self, rate, **kwargs):
        super().__init__(**kwargs)
        self.rate = rate
        self.seed_generator = keras.random.SeedGenerator(7)

    def call(self, x):
        keep = keras.random.uniform(ops.shape(x), dtype=self.compute_dtype, seed=self.seed_generator) >= self.rate
        return ops.where(keep, x / (1 - self.rate), ops.zeros_like(x))


RATE, WIDTH = 0.002, 1024


def hand_dropout_model():
    inputs = keras.Input((WIDTH,))
    return keras.Model(inputs, keras.layers.Activation("linear", name="out")(HandDropout(RATE, name="drop")(inputs)))


def _dropped(model):
    return float(np.mean(np.asarray(model(np.ones((WIDTH, WIDTH), "float32"))) == 0))


@pytest.mark.filterwarnings("ignore::tfmp.PerformanceWarning")
@pytest.mark.parametrize("policy, steps", [("mixed_bfloat16", 128), ("mixed_float16", 1024)])
def test_a_hand_written_dropout_drawing_in_16_bits_drops_its_rate(policy, steps):
    """Item 2 (keras.random in user layers): a 16-bit uniform draw comes in steps of 1/128
    (bfloat16) or 1/1024 (float16), so a rate of 0.002 counts as a whole step in plain
    Keras; tfmp draws in float32 and drops the rate, within a binomial bound (1e-6)."""
    from scipy.stats import binom

    low, high = (bound / WIDTH**2 for bound in binom.interval(1 - 1e-6, WIDTH**2, RATE))
    assert _dropped(_plain(policy, hand_dropout_model)) > high
    model = _with_tfmp(policy, hand_dropout_model)
    assert low <= _dropped(model) <= high
    low_dtype = policy.split("_")[1]
    assert _why(model)["drop"] == f"{low_dtype} random draw: uniform in steps of 1/{steps:,} compared with a threshold"
