"""``fit`` and ``evaluate`` of one model under a multi-worker `tf.distribute` strategy.

Keras 3 fails there before the first step (keras-team/keras#20585, #20329): (1)
``_maybe_symbolic_build`` reduces the first distributed batch, a structure the strategy cannot
reduce (`error_texts.PER_REPLICA_CONVERSION`); on that error tfmp builds from this worker's own
batch instead. (2) Each step's logs are averaged over axis 0, which fails on scalars: once (1)
was needed, ``train_step`` and ``test_step`` return each scalar log as a one-element vector.
``tests/test_multi_worker_fit.py`` says when Keras fixes (1). Hooks per model, owner ``"multi_worker"``.

| private name used | where in Keras | what tfmp does with it |
|---|---|---|
| ``TensorFlowTrainer._maybe_symbolic_build(iterator=None, data_batch=None)`` (Keras 3.12-3.15), ``Trainer._maybe_symbolic_build`` (3.16) (`SYMBOLIC_BUILD`) | ``keras/src/backend/tensorflow/trainer.py`` | hooked per model: the batch Keras averages is replaced by this worker's own |
"""

from __future__ import annotations

from typing import Any, Callable

import tensorflow as tf

from tfmp._src.keras_hooks import error_texts, patches, trainer
from tfmp._src.keras_hooks.object_state import PerObjectHooks

SYMBOLIC_BUILD = "_maybe_symbolic_build"
_STATE = PerObjectHooks("multi_worker")

OnStart = Callable[[Any], None]


def is_multi_worker(strategy: Any) -> bool:
    """Bool. Whether `strategy` spans several worker processes (replicas beyond this worker's devices)."""
    if not isinstance(strategy, tf.distribute.MultiWorkerMirroredStrategy):
        return False
    return int(strategy.num_replicas_in_sync) > len(strategy.extended.worker_devices)


def local_batch(strategy: Any, batch: Any) -> Any:
    """`batch` with each distributed value replaced by this worker's first replica's part."""
    return tf.nest.map_structure(
        lambda value: strategy.experimental_local_results(value)[0]
        if isinstance(value, tf.distribute.DistributedValues) else value,
        batch,
    )


def _as_vectors(logs: Any) -> Any:
    """Every scalar tensor of `logs` as a vector of one element; anything else unchanged."""
    return tf.nest.map_structure(
        lambda value: tf.reshape(value, [1])
        if tf.is_tensor(value) and value.shape.rank == 0 else value,
        logs,
    )


class _ModelFix:
    """The hooks of one model and whether Keras's own build failed on it."""

    def __init__(self, model: Any, on_start: OnStart) -> None:
        self.model, self.on_start = model, on_start
        self.needed = False  # Keras's own build raised PER_REPLICA_CONVERSION
        self.hooks = patches.install_all([
            lambda: trainer.subscribe(model, SYMBOLIC_BUILD, self._wrap_build, owner="multi_worker"),
            lambda: trainer.subscribe(model, "train_step", self._wrap_step, owner="multi_worker"),
            lambda: trainer.subscribe(model, "test_step", self._wrap_step, owner="multi_worker"),
        ])

    def _wrap_build(self, build: Callable) -> Callable:
        def symbolic_build(iterator: Any = None, data_batch: Any = None) -> Any:
            strategy = self.model.distribute_strategy
            if iterator is None or not is_multi_worker(strategy):
                return build(iterator=iterator, data_batch=data_batch)
            self.on_start(self.model)
            try:
                return build(iterator=iterator)
            except ValueError as error:
                if not error_texts.is_per_replica_conversion(error):
                    raise
            self.needed = True
            for _, _, batches in iterator:
                batch = next(batches)
                break
            return build(data_batch=local_batch(strategy, batch))

        return symbolic_build

    def _wrap_step(self, step: Callable) -> Callable:
        def step_with_vector_logs(data: Any) -> Any:
            logs = step(data)
            return _as_vectors(logs) if self.needed else logs

        return step_with_vector_logs

    def remove(self) -> None:
        for hook in reversed(self.hooks):
            hook.remove()


def install(model: Any, on_start: OnStart) -> None:
    """Makes `model`'s ``fit`` and ``evaluate`` work under a multi-worker strategy; replaces an earlier install.

    ``on_start(model)`` runs first in each, before Keras reads a batch; it may raise to refuse the call.
    """
    _STATE.replace(model, lambda: _ModelFix(model, on_start))


def remove(model: Any) -> None:
    """Takes `model`'s hooks off (nothing when it has none)."""
    _STATE.discard(model)
