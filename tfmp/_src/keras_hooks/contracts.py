"""What tfmp assumes of Keras's methods and call order, in one table each, each row tested.

Beside the private names (`keras_private`) and the error texts (`error_texts`),
tfmp's hooks rest on two kinds of Keras behaviour:

* `HOOKED_SIGNATURES`: the parameters of each Keras method a hook replaces and
  names (it declares them, passes them on by name or sets one): ``(class, method,
  parameters)``, the parameters in Keras's order after ``self``/``cls``. A hook
  passing ``*args, **kwargs`` through unchanged needs no row.
* `CALL_ORDER`: the order in which Keras calls what tfmp hooks, each with the
  test that checks it on the installed pair (``tests/<module>::<test>``).

``tests/test_keras_hooks.py`` checks every signature and that every named test
exists; ``.ci/run`` runs both on the oldest and the newest supported Keras.
"""

from __future__ import annotations

from typing import Tuple

import keras
import tensorflow as tf

#: (class whose method is hooked, method, the parameters tfmp relies on, in order).
HOOKED_SIGNATURES: Tuple[Tuple[type, str, Tuple[str, ...]], ...] = (
    # model_hooks: the optimizer is the first argument or `optimizer=`; loading
    # sets `auto_scale_loss=False`.
    (keras.Model, "compile", ("optimizer", "loss")),
    (keras.Model, "compile_from_config", ("config",)),
    # model_hooks / train_function: `make_train_function(force=False)`.
    (keras.Model, "make_train_function", ("force",)),
    # step_scope: `make_test_function(force=False)`, `make_predict_function(force=False)`.
    (keras.Model, "make_test_function", ("force",)),
    (keras.Model, "make_predict_function", ("force",)),
    # numerics: `train_step(data)`.
    (keras.Model, "train_step", ("data",)),
    # fused_batchnorm: `call(inputs, training=None, mask=None)`.
    (keras.layers.BatchNormalization, "call", ("inputs", "training", "mask")),
    # token_ids: `Embedding.call(inputs)`, `DTypePolicy.convert_input(x, autocast, dtype)`.
    (keras.layers.Embedding, "call", ("inputs",)),
    (keras.DTypePolicy, "convert_input", ("x", "autocast", "dtype")),
    # float32.build: `build(input_shape)`; float32.from_config: `from_config(config)`.
    (keras.layers.Layer, "build", ("input_shape",)),
    (keras.layers.Layer, "from_config", ("config",)),
    # numerics, grad_stats, optimizer: `apply(grads, trainable_variables=None)`, `scale_loss(loss)`.
    (keras.optimizers.Optimizer, "apply", ("grads", "trainable_variables")),
    (keras.optimizers.LossScaleOptimizer, "scale_loss", ("loss",)),
    # custom_optimizers: Layer.__setattr__ calls `_setattr_hook(name, value)`, which returns both.
    (keras.Model, "_setattr_hook", ("name", "value")),
    # LossScaleOptimizerBase overrides Keras's stateful branches.
    (keras.optimizers.LossScaleOptimizer, "_stateful_handle_finite_grads", ("grads", "trainable_variables")),
    (keras.optimizers.LossScaleOptimizer, "_stateful_handle_non_finite_grads", ()),
    # gradient_errors: `GradientTape.gradient(target, sources, ...)`, the sources read.
    (tf.GradientTape, "gradient", ("target", "sources")),
)

#: (what tfmp relies on Keras doing, the test that checks it).
CALL_ORDER: Tuple[Tuple[str, str], ...] = (
    ("compute_loss sums `model.losses`, read through the Layer.losses property",
     "tests/test_attachment.py::test_a_model_compiled_while_enabled_sums_its_16_bit_loss_terms_after_disable"),
    ("fit calls make_train_function, then model.train_function once per execution",
     "tests/test_keras_hooks.py::test_train_function_checks_run_in_order_and_come_off_independently"),
    ("load_model compiles through compile_from_config, which calls compile",
     "tests/test_invisible.py::test_loading_a_mixed_float16_model_with_overflows_while_enabled_keeps_its_state"),
    ("load_model makes each layer with from_config before calling it symbolically",
     "tests/test_attachment.py::test_a_custom_layer_producing_an_output_loads_while_enabled"),
    ("Layer.__call__ calls the instance's call, inside Keras's call context naming the entry layer",
     "tests/test_attachment.py::test_a_sublayer_made_after_attaching_takes_its_models_attachment_in_any_thread"),
    ("fit raises out of itself whatever a callback or the data iterator raises, without on_train_end",
     "tests/test_monitor.py::test_any_error_out_of_fit_closes_the_monitor_and_the_next_fit_starts_clean"),
    ("make_train_function binds model.train_step when it makes the function (a later train_step hook needs a remake)",
     "tests/test_safety.py::test_one_nan_input_the_forward_pass_hides_is_skipped"),
    ("BatchNormalization.call writes the moving statistics during a training call, before optimizer.apply",
     "tests/test_safety.py::test_a_gradient_overflow_skip_puts_the_statistics_back"),
    ("Layer.__setattr__ passes each assignment on a model through the instance's _setattr_hook",
     "tests/test_custom_compile.py::test_optimizers_set_before_super_compile_or_after_it_are_wrapped_and_lists_warned_about"),
    ("train_step calls tf.GradientTape.gradient with the model's trainable weights as sources; "
     "a built-in op's gradient runs in error_texts.GRADIENT_FRAME, naming the forward layer's scope",
     "tests/test_user_code_dtypes.py::test_a_float32_gradient_returned_under_bfloat16_is_named_where_it_arrives"),
    ("tf.GradientTape.gradient runs a built-in op's gradient in error_texts.GRADIENT_FRAME",
     "tests/test_keras_hooks.py::test_tensorflow_still_runs_an_op_gradient_in_the_gradient_frame"),
    ("tape.gradient calls a tf.custom_gradient function below itself, in a frame of its own",
     "tests/test_user_code_dtypes.py::test_backward_error_in_fit_names_layer_dtypes_and_fix"),
    ("LossScaleOptimizer.apply runs _stateful_handle_finite_grads or _stateful_handle_non_finite_grads",
     "tests/test_loss_scale.py::test_backoff_sequence_from_400"),
    ("an eager tf.function call takes the calling thread's function_call_options as its Grappler "
     "config, and the runtime instantiates the function again for another config",
     "tests/test_float16_fusion.py::test_a_plain_tf_function_is_instantiated_with_and_without_the_remapper"),
    ("Normalization casts its mean and variance to the compute dtype in build (given) or "
     "finalize_state (adapted, from float32 variables); calling them again after a policy "
     "change casts them again (exact_layers.refresh_state)",
     "tests/test_public_bug_kinds_exact.py::"
     "test_exact_layers_made_before_enable_are_forced_at_compile_with_their_state_cast_again"),
    ("Operation.__new__ reads a layer class's __init__ signature (getfullargspec), which a "
     "hooked __init__'s pass-through carries as __signature__",
     "tests/test_public_bug_kinds_exact.py::"
     "test_the_rule_forces_exact_layers_made_while_enabled_unless_excluded"),
    ("keras.ops.gelu (so activation='gelu', keras.activations.gelu, Activation('gelu')) calls "
     "gelu(x, approximate) looked up on backend.nn at each call",
     "tests/test_gelu.py::test_where_the_16_bit_gelu_is_slow_a_model_computes_its_exact_gelus_in_float32_only"),
    ("keras.ops.conv and conv_transpose (so Conv1D/2D/3D and their transposes) call "
     "conv(inputs, kernel, ...) and conv_transpose(inputs, kernel, ...) looked up on backend.nn at each call",
     "tests/test_conv.py::test_keras_still_calls_the_backend_convolutions_by_module_attribute"),
    ("keras.ops.add (so Dense's and the convolutions' bias) calls add(x1, x2) looked up on "
     "backend.numpy at each call, which adds a bias vector with tf.nn.bias_add",
     "tests/test_bias_gradient.py::test_keras_still_calls_the_backend_add_by_module_attribute"),
    ("Layer.__call__ runs call inside backend.name_scope(layer.name, caller=layer), on the "
     "thread's name_scope_stack (keras_private.calling_layer)",
     "tests/test_gelu.py::test_an_attached_model_keeps_its_gelu_inside_a_model_tfmp_did_not_attach"),
    ("saving writes model.get_compile_config() (Trainer's, hooked while tfmp optimizers live) and, under "
     "optimizer/<attribute>, every KerasSaveable attribute of the optimizer (loss_scale_counters); "
     "loading a built-in class accepts a registered_name equal to its class name and ignores "
     "unknown keys beside an entry's config (saved_form)",
     "tests/test_saved_form.py::test_a_file_saved_under_tfmp_opens_in_plain_keras_in_a_process_without_tfmp"),
    ("fit, evaluate and predict call make_train/test/predict_function, then the model's "
     "train/test/predict_function, in the calling thread",
     "tests/test_float16_fusion.py::test_with_the_trap_a_float16_model_steps_without_fused_matmuls_and_a_float32_model_keeps_them"),
)
