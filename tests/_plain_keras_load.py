"""Loads a `.keras` file with plain Keras in a process that cannot import tfmp.

Started by tests/test_saved_form.py with `_subproc.without_module(..., "tfmp")`
first on PYTHONPATH. Writes to ``--out`` (JSON): the loaded optimizer's class
and state, the layers' policies, configs and weights, the warnings loading gave, whether
one more training step ran finite, and whether tfmp was ever imported.
"""

import argparse
import json
import sys
import warnings

import numpy as np


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--model", required=True)
    args = parser.parse_args()
    import keras

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model = keras.models.load_model(args.model)
    optimizer = model.optimizer
    found = {
        "optimizer": f"{type(optimizer).__module__}.{type(optimizer).__name__}",
        "inner": type(optimizer.inner_optimizer).__name__,
        "scale": float(optimizer.dynamic_scale.numpy()),
        "initial_scale": float(optimizer.initial_scale),
        "dynamic_growth_steps": int(optimizer.dynamic_growth_steps),
        "inner_iterations": int(optimizer.inner_optimizer.iterations.numpy()),
        "inner_variables": [v.numpy().tolist() for v in optimizer.inner_optimizer.variables],
        "policies": [layer.dtype_policy.name for layer in model.layers],
        "configs": {layer.name: layer.get_config() for layer in model.layers},
        "weights": [w.tolist() for w in model.get_weights()],
        "warnings": [str(w.message) for w in caught],
    }
    x = np.ones((4,) + tuple(model.inputs[0].shape[1:]), "float32")
    y = np.ones((4,) + tuple(model.outputs[0].shape[1:]), "float32")
    found["loss_after_one_step"] = float(model.train_on_batch(x, y))
    found["scale_after_one_step"] = float(optimizer.dynamic_scale.numpy())
    found["tfmp_imported"] = any(name.partition(".")[0] == "tfmp" for name in sys.modules)
    with open(args.out, "w") as f:
        json.dump(found, f, default=str)


if __name__ == "__main__":
    main()
