"""The saved form of `tfmp.LossScaleOptimizer`: a `.keras` file plain Keras opens.

The compile config (hooked in `loops`) names Keras's `LossScaleOptimizer` with Keras's keys,
tfmp's settings under `SETTINGS_KEY` in the inner optimizer's entry; the weights file keeps
Keras's variables and order, the counters in ``optimizer/loss_scale_counters``. Earlier tfmp
files (``"tfmp>LossScaleOptimizer"``) still load.
"""

from __future__ import annotations

import functools
import weakref
from typing import Any, List

import keras

from tfmp._src.loss_scale import state_check

#: The key under which tfmp's settings ride in the inner optimizer's serialized entry.
SETTINGS_KEY = "tfmp_loss_scale_settings"
#: The registered name of the Keras form (equal to Keras's class name).
KERAS_NAME = "LossScaleOptimizer"
#: ``dynamic_growth_steps`` Keras reads for a fixed scale: never reached, so the scale stays 1.0.
FIXED_SCALE_GROWTH_STEPS = 2**62
_KERAS_FORM = {"module": "keras.optimizers", "class_name": KERAS_NAME, "registered_name": KERAS_NAME}
_TFMP_NAME = "tfmp>LossScaleOptimizer"


@functools.lru_cache(maxsize=1)
def _keras_keys() -> frozenset:
    """The config keys Keras's LossScaleOptimizer takes (read from Keras, not listed here)."""
    return frozenset(keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD()).get_config())


def keras_form(serialized: Any) -> Any:
    """A new dict: `serialized` (an optimizer's `serialize_keras_object`) in Keras's form if it is tfmp's."""
    if not (isinstance(serialized, dict) and serialized.get("registered_name") == _TFMP_NAME):
        return serialized
    settings = {k: v for k, v in serialized["config"].items() if k not in ("name", "inner_optimizer")}
    config = {k: v for k, v in serialized["config"].items() if k in _keras_keys()}
    if not settings.get("loss_scaling", True):
        config.update(initial_scale=1.0, dynamic_growth_steps=FIXED_SCALE_GROWTH_STEPS)
    config["inner_optimizer"] = {**serialized["config"]["inner_optimizer"], SETTINGS_KEY: settings}
    return {**serialized, **_KERAS_FORM, "config": config}


def from_keras_form(config: dict) -> dict:
    """A new dict: a loss-scale optimizer's ``config`` (either form) with tfmp's settings back in place."""
    inner = config.get("inner_optimizer")
    if not (isinstance(inner, dict) and SETTINGS_KEY in inner):
        return dict(config)
    inner = dict(inner)
    settings = inner.pop(SETTINGS_KEY)
    return {**config, **settings, "inner_optimizer": inner}


def compile_config_in_keras_form(config: Any) -> Any:
    """A model's compile config with its optimizer entry in the Keras form (`keras_form`)."""
    if isinstance(config, dict) and "optimizer" in config:
        config = {**config, "optimizer": keras_form(config["optimizer"])}
    return config


def keras_layout(optimizer: Any) -> List[Any]:
    """The variables Keras's `LossScaleOptimizer` saves, in its order: `optimizer`'s but its counters."""
    ids = {id(v) for v in optimizer.counter_variables()}
    return [v for v in optimizer.variables if id(v) not in ids]


def save_variables(variables: List[Any], store: Any) -> None:
    """Writes `variables` as ``store["0"], store["1"], ...`` (Keras's layout)."""
    for i, variable in enumerate(variables):
        store[str(i)] = variable.numpy()


def load_variables(variables: List[Any], store: Any, optimizer: Any) -> bool:
    """Assigns ``store["0"], ...`` to `variables`; False (nothing assigned) if the counts differ.

    Raises:
        ValueError: (template, `state_check`) nothing assigned: a value no run of `optimizer` reaches.
    """
    if len(store.keys()) != len(variables):
        return False
    state_check.refuse_impossible(optimizer, ((v.name, store[str(i)]) for i, v in enumerate(variables)),
                                  loading=True)
    for i, variable in enumerate(variables):
        variable.assign(store[str(i)])
    return True


class CounterStore(keras.layers.Layer):
    """Saves and loads an optimizer's counters as its ``loss_scale_counters``; a group missing or of
    another length leaves them as they are."""

    def __init__(self, optimizer: Any) -> None:
        super().__init__(name="loss_scale_counters", trainable=False)
        object.__setattr__(self, "_optimizer", weakref.ref(optimizer))

    def _counters(self) -> List[Any]:
        optimizer = self._optimizer()
        return optimizer.counter_variables() if optimizer is not None else []

    def save_own_variables(self, store: Any) -> None:
        save_variables(self._counters(), store)

    def load_own_variables(self, store: Any) -> None:
        optimizer = self._optimizer()
        if optimizer is not None:
            load_variables(optimizer.counter_variables(), store, optimizer)
