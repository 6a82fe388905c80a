"""A mixed-precision model that trains variables stored in 16 bits is told so once, naming them."""

import warnings

import keras
import numpy as np
import pytest

import tfmp


class Scale(keras.layers.Layer):
    """A layer whose author stores its weights in `dtype` whatever the policy."""

    def __init__(self, dtype_of_weights=None, **kwargs):
        super().__init__(**kwargs)
        self.dtype_of_weights = dtype_of_weights

    def build(self, input_shape):
        self.gain = self.add_weight(shape=(input_shape[-1],), initializer="ones", dtype=self.dtype_of_weights,
                                    name="gain")
        self.steps = self.add_weight(shape=(), initializer="zeros", dtype="bfloat16", trainable=False,
                                     name="steps")  # not trained: nothing to say

    def call(self, x):
        return x * keras.ops.cast(self.gain, x.dtype)


def _model(dtype_of_weights):
    return keras.Sequential([keras.Input((4,)), Scale(dtype_of_weights, name="scale"),
                             keras.layers.Dense(1, name="out")])


@pytest.mark.parametrize("policy, dtype, effect", [
    ("mixed_bfloat16", "bfloat16", "beta_2 = 0.999 is 1.0 in bfloat16"),
    ("mixed_float16", "float16", "holds at most 65504"),
])
def test_a_16_bit_trainable_variable_is_named_at_compile_with_its_effect_and_fix(policy, dtype, effect):
    with tfmp.policy_scope(policy):
        model = _model(dtype)
        with pytest.warns(UserWarning, match="trains 1 variable") as caught:
            model.compile("adam", "mse")
        with warnings.catch_warnings():
            warnings.simplefilter("error", UserWarning)  # once per model
            model.fit(np.ones((8, 4)), np.ones((8, 1)), verbose=0)
    text = [str(w.message) for w in caught if "trains 1 variable" in str(w.message)][0]
    assert f"'scale/gain' ({dtype})" in text and "steps" not in text
    assert effect in text and "pass dtype='float32'" in text
    assert model.get_layer("scale").gain.dtype == dtype  # said, not changed


def test_a_subclassed_model_built_at_fit_is_checked_then_and_float32_variables_say_nothing():
    class Net(keras.Model):
        def __init__(self):
            super().__init__()
            self.scale, self.out = Scale("bfloat16", name="scale"), keras.layers.Dense(1)

        def call(self, x):
            return self.out(self.scale(x))

    with tfmp.policy_scope("mixed_bfloat16"):
        model = Net()
        model.compile("adam", "mse")  # not built: nothing known yet
        with pytest.warns(UserWarning, match=r"Optimizer .* trains 1 variable.*/scale/gain' \(bfloat16\)"):
            model.fit(np.ones((8, 4)), np.ones((8, 1)), verbose=0)
        plain = _model(None)  # the policy's float32 variables
        with warnings.catch_warnings():
            warnings.simplefilter("error", UserWarning)
            plain.compile("adam", "mse")
            plain.fit(np.ones((8, 4)), np.ones((8, 1)), verbose=0)
