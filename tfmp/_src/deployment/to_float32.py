"""`tfmp.to_float32`: a float32 copy of a trained model, for deployment.

The copy goes through the `get_config` / `from_config` round trip `model.save()` uses,
every dtype policy overridden to float32, then the weights are copied by value.
"""

from __future__ import annotations

from typing import Any

import keras
import numpy as np

from tfmp._src.errors import invalid_argument, model_fix
from tfmp._src.layer_tree import walk

_POLICY_CLASSES = ("DTypePolicy", "FloatDTypePolicy", "DTypePolicyMap")

_TEMPLATE_FIX = (
    "Implement `get_config()` in {cls} returning its constructor arguments "
    "(with `**kwargs` passed on to `super().__init__`), and `from_config()` when "
    "some of them are not plain Python values (layers, arrays, callables); then "
    "`{cls}.from_config(model.get_config())` rebuilds it and to_float32 can copy it."
)


def to_float32(model: keras.Model) -> keras.Model:
    """Returns a float32 copy of `model` with the same weights, for deployment.

    Every layer of the copy has the ``"float32"`` dtype policy; every floating-point
    variable holds the trained value cast to float32 (identical for a mixed policy's
    float32 master weights), integer variables keep their dtype and value. `model` is
    not changed.

    Ship this copy, not the trained model: a model saved under a mixed policy keeps
    computing in 16 bits wherever it is loaded, and TFLite's builtin kernels refuse
    its bfloat16/float16 ops. ``tfmp.to_float32(model).save("model.keras")`` writes
    a file that plain Keras loads, without tfmp, for float32 inference::

        model = keras.models.load_model("model.keras", compile=False)

    Args:
        model: A built `keras.Model`: Sequential, Functional (nested models
            included) or a subclassed model whose class implements `get_config`
            (and `from_config` when its constructor takes non-plain values).

    Returns:
        A new, uncompiled, built `keras.Model` of the same class and structure.

    Raises:
        ValueError: `model` is not a built `keras.Model`, or it (or one of its
            layers) is a subclass that cannot be rebuilt from its config; the
            message names the class and what it must implement.

    Example:
        >>> import keras, numpy as np, tfmp
        >>> with tfmp.policy_scope("mixed_bfloat16"):
        ...     trained = keras.Sequential([keras.Input((4,)), keras.layers.Dense(2)])
        >>> copy = tfmp.to_float32(trained)
        >>> trained.layers[0].compute_dtype, copy.layers[0].compute_dtype
        ('bfloat16', 'float32')
        >>> all(np.array_equal(a, b) for a, b in zip(trained.get_weights(), copy.get_weights()))
        True
    """
    if not isinstance(model, keras.Model):
        raise invalid_argument("model", model, "a built `keras.Model`",
                               fix=model_fix("tfmp.to_float32(model)"))
    if not model.built:
        raise invalid_argument(
            "model", model, "a built `keras.Model`",
            fix="Build it first: call it on a batch or call `model.build(input_shape)`.",
        )
    before = keras.config.dtype_policy()
    keras.config.set_dtype_policy("float32")  # for the layers the rebuild creates
    try:
        copy = _rebuild(model)
    finally:
        keras.config.set_dtype_policy(before)
    _copy_weights(model, copy)
    return copy


def _float32_config(config: Any) -> Any:
    """`config` with every serialized dtype policy, nested ones included, replaced by ``"float32"``.

    Plain dtype strings stay: an `InputLayer`'s ``"dtype": "int32"`` is its data's, not a policy.
    """
    if isinstance(config, dict):
        return {key: "float32" if key == "dtype" and _is_policy(value) else _float32_config(value)
                for key, value in config.items()}
    if isinstance(config, (list, tuple)):
        return type(config)(_float32_config(item) for item in config)
    return config


def _is_policy(value: Any) -> bool:
    return (isinstance(value, keras.DTypePolicy)
            or (isinstance(value, dict) and value.get("class_name") in _POLICY_CLASSES)
            or (isinstance(value, str) and value.startswith("mixed_")))


def _rebuild(model: keras.Model) -> keras.Model:
    """`model` rebuilt through Keras's serialization, every policy float32, uncompiled.

    The compile config is dropped (tfmp's `LossScaleOptimizer` would make the file need
    tfmp to load); `keras.models.clone_model` would compile the clone like the original.
    """
    classes = {type(entry.layer).__name__: type(entry.layer) for entry in walk(model)}
    classes[type(model).__name__] = type(model)
    try:
        config = keras.saving.serialize_keras_object(model)
        config.pop("compile_config", None)
        copy = keras.saving.deserialize_keras_object(
            _float32_config(config), custom_objects=classes
        )
    except (NotImplementedError, TypeError, ValueError) as error:
        raise _not_rebuildable(_first_unconfigurable(model), error) from error
    if not copy.built or len(copy.weights) != len(model.weights):
        raise _not_rebuildable(
            model, f"the rebuilt model has {len(copy.weights)} variables, not "
            f"{len(model.weights)}: its `build()` does not create them all"
        )
    return copy


def _first_unconfigurable(model: keras.Model) -> Any:
    """The deepest layer whose `get_config` raises (a reversed pre-order walk); else the model."""
    for layer in [entry.layer for entry in reversed(walk(model))] + [model]:
        try:
            layer.get_config()
        except NotImplementedError:
            return layer
    return model


def _not_rebuildable(layer: Any, cause: Any) -> ValueError:
    cls = type(layer).__name__
    text = " ".join(line.strip() for line in str(cause).splitlines() if line.strip())
    cause = (text.split(". ")[0].rstrip(".")[:300]) or type(cause).__name__
    return invalid_argument(
        "model",
        layer,
        "a Sequential or Functional model, or layers and subclassed models that "
        f"can be rebuilt from their config (rebuilding {cls} failed: {cause})",
        fix=_TEMPLATE_FIX.format(cls=cls),
    )


def _copy_weights(source: keras.Model, target: keras.Model) -> None:
    """Assigns `source`'s variable values to `target` in tracking order, floats cast to float32.

    `_rebuild` has checked the count; shapes are checked before anything is written.
    """
    pairs = list(zip(source.weights, target.weights))
    if any(tuple(a.shape) != tuple(b.shape) for a, b in pairs):
        raise _not_rebuildable(
            source,
            "its copy's variables do not match the trained model's "
            f"({len(target.weights)} against {len(source.weights)}, or shapes differ)",
        )
    for src, dst in pairs:
        value = np.asarray(src.numpy())
        floating = np.issubdtype(value.dtype, np.floating) or "float" in str(src.dtype)
        dst.assign(value.astype(np.float32 if floating else dst.dtype))
