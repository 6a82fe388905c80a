"""The options of `tfmp.enable()` and `tfmp.policy_scope()`, checked before any state changes."""

from __future__ import annotations

import inspect
from typing import Optional, Union

from tfmp._src.errors import invalid_argument, unknown_key
from tfmp._src.loss_scale.guard import LOSS_GUARDS
from tfmp._src.loss_scale.optimizer import WRAP_OPTIONS, check_wrap_options
from tfmp._src.numerics.check import check_numerics, check_options


def checked_loss_scale_options(options: Optional[dict]) -> dict:
    """Validates `loss_scale_options` as `tfmp.LossScaleOptimizer` would, making none.

    Checked as for float16 (every bound, with loss scaling on; a ``guard`` valid
    only without it left out), before `enable()` resolves the policy, so that a
    bad option raises before the policy's warnings; `enable()` then checks them
    for the policy's compute dtype (``check_wrap_options``). No op runs:
    `enable()` may come before a multi-worker strategy configures TensorFlow.

    Raises:
        ValueError: (template) not a dict or None, an unknown key, or a value
            `tfmp.LossScaleOptimizer` refuses.
    """
    if options is None:
        return {}
    if not isinstance(options, dict):
        raise invalid_argument(
            "loss_scale_options", options, "a dict of tfmp.LossScaleOptimizer arguments",
            fix="Pass e.g. loss_scale_options={'initial_scale': 2.0**15}.",
        )
    for key in options:
        if key not in WRAP_OPTIONS:
            raise unknown_key("loss_scale_options", options, key, WRAP_OPTIONS)
    probe = {key: value for key, value in options.items()
             if not (key == "guard" and value in LOSS_GUARDS)}
    check_wrap_options("float16", **probe)
    return dict(options)


def check_debug(debug: Union[bool, dict]) -> None:
    """Validates the `debug` option of `enable()` now, as `tfmp.check_numerics` checks its own.

    Which ``layers`` exist is checked at compile, against the model.

    Raises:
        ValueError: (template) not a bool or dict, an unknown key, or a value
            `tfmp.check_numerics` refuses (named by its key, e.g. `action`).
    """
    if isinstance(debug, bool):
        return
    if not isinstance(debug, dict):
        raise invalid_argument(
            "debug", debug, "a bool or a dict of tfmp.check_numerics options",
            fix="Pass debug=True, or e.g. debug={'action': 'warn'}.",
        )
    parameters = inspect.signature(check_numerics).parameters
    allowed = [name for name in parameters if name not in ("model", "enabled")]
    for key in debug:
        if key not in allowed:
            raise unknown_key("debug", debug, key, allowed)
    options = {name: parameters[name].default for name in allowed}
    check_options(**{**options, **debug})

