"""What tfmp assumes of Keras's methods and call order, gathered from each surface module, each row tested.

Each surface module of `tfmp._src.keras_hooks` holds its own rows (see
`surfaces`); this module gathers them. Beside the private names (each in its
surface module's table, `REQUIRED_ATTRIBUTES` here) and the error texts
(`error_texts`), tfmp's hooks rest on two kinds of Keras behaviour:

* `HOOKED_SIGNATURES`: the parameters of each Keras method a hook replaces and
  names (it declares them, passes them on by name or sets one): ``(class, method,
  parameters)``, the parameters in Keras's order after ``self``/``cls``. A hook
  passing ``*args, **kwargs`` through unchanged needs no row. The backend functions
  `backend_ops` hooks have theirs in `backend_ops.FUNCTION_SIGNATURES`.
* `CALL_ORDER`: the order in which Keras calls what tfmp hooks, each with the
  test that checks it on the installed pair (``tests/<module>::<test>``).

``tests/test_keras_hooks.py`` checks every signature and that every named test
exists; ``.ci/run`` runs both on the oldest and the newest supported Keras.
"""

from __future__ import annotations

from typing import Tuple

from tfmp._src.keras_hooks import (
    backend_ops,
    gradient_tape,
    layer_calls,
    loss_terms,
    optimizer_steps,
    runtime_options,
    trainer,
)

#: The surface modules, each holding its own rows.
_SURFACE_MODULES = (trainer, layer_calls, loss_terms, optimizer_steps, backend_ops, gradient_tape,
                    runtime_options)

#: (class whose method is hooked, method, the parameters tfmp relies on, in order).
HOOKED_SIGNATURES: Tuple[Tuple[type, str, Tuple[str, ...]], ...] = tuple(
    row for module in _SURFACE_MODULES for row in getattr(module, "SIGNATURES", ()))

#: (what tfmp relies on Keras doing, the test that checks it).
CALL_ORDER: Tuple[Tuple[str, str], ...] = tuple(
    row for module in _SURFACE_MODULES for row in getattr(module, "CALL_ORDER", ()))

#: (class, attribute) pairs that must exist on the installed Keras's classes; the
#: test suite checks every one (and runs each accessor on a real model, for the
#: instance attributes), so an upgrade that renames one fails in one place.
REQUIRED_ATTRIBUTES: Tuple[Tuple[type, str], ...] = tuple(
    row for module in _SURFACE_MODULES for row in getattr(module, "REQUIRED_ATTRIBUTES", ()))
