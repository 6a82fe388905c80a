"""Public mixed-precision bug reports against Keras and TensorFlow, reduced to small inputs.

One test per kind, each citing its report: plain Keras mixed precision gets the
value wrong (shown first, so the case stays a real one), tfmp gets float32's
value (within the 16-bit tolerance of the layers that still compute in 16 bits).
"""

import keras
import numpy as np

import tfmp


def _attention_model():
    query, value = keras.Input((4, 8)), keras.Input((5, 8))
    mask = [None, keras.ops.convert_to_tensor(np.array([[True] * 3 + [False] * 2] * 2))]
    attended = keras.layers.Attention()([query, value], mask=mask)
    return keras.Model([query, value], keras.layers.Dense(3)(attended))


def _predict_under(policy, build, weights, x, *, with_tfmp):
    """`build()`'s prediction under `policy`, with `weights`, plain Keras or tfmp."""
    if with_tfmp:
        with tfmp.policy_scope(policy):
            model = build()
            model.compile("sgd", "mse")
    else:
        keras.config.set_dtype_policy(policy)  # restored by conftest's restore_global_policy
        model = build()
        keras.config.set_dtype_policy("float32")
        model.compile("sgd", "mse")
    model.set_weights(weights)
    return model.predict(x, verbose=0), model


def test_attention_scores_near_1e5_keep_float32_values_tensorflow_46064():
    """tensorflow#46064: `keras.layers.Attention` with a mask and unscaled dot-product
    scores around 1e5 (inputs of scale 300 over 8 features) under mixed_float16:
    the scores overflow float16 (65504) before the softmax and `predict` returns NaN."""
    rng = np.random.default_rng(0)
    x = [(300 * rng.normal(size=(2, 4, 8))).astype("float32"),
         (300 * rng.normal(size=(2, 5, 8))).astype("float32")]
    keras.utils.set_random_seed(0)
    reference = _attention_model()
    weights = reference.get_weights()
    expected = reference.predict(x, verbose=0)
    plain, _ = _predict_under("mixed_float16", _attention_model, weights, x, with_tfmp=False)
    assert np.isnan(plain).all()  # the report's failure, in plain Keras
    got, model = _predict_under("mixed_float16", _attention_model, weights, x, with_tfmp=True)
    assert got.dtype == np.float32 and np.isfinite(got).all()
    # The attention's inputs arrive in float16 (relative step 2**-10), so its output
    # carries that rounding: 2**-8 of the output's scale bounds it.
    np.testing.assert_allclose(got, expected, rtol=0, atol=2**-8 * np.abs(expected).max())
    [row] = [r for r in tfmp.audit(model).rows if r.class_name == "Attention"]
    assert (row.compute_dtype, row.why) == ("float32", "softmax inside")
