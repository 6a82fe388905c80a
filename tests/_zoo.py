"""Small models of common architectures, shared by the zoo tier and the dtype tests.

Each builder takes no argument and returns ``Case``: the model (built under the
current global policy), its data and its compile arguments. Inputs are the
smallest each architecture accepts, with a handful of classes, so that a few
training steps run in seconds on a CPU.
"""

import dataclasses
from typing import Any, Callable, Dict

import keras
import numpy as np
import tensorflow as tf
from keras import layers, ops

BATCH = 4  # two steps of 2


@dataclasses.dataclass
class Case:
    """A model ready to compile, with its data.

    Attributes:
        model: ``keras.Model``, built under the global policy at creation.
        x: Inputs (array or dict of arrays), ``BATCH`` samples.
        y: Targets (array, dict of arrays, or None for a model with only ``add_loss``).
        loss: The ``loss`` argument of ``compile`` (None: the model adds its own).
    """

    model: keras.Model
    x: Any
    y: Any
    loss: Any


def _images(size, channels=3):
    return np.random.default_rng(0).uniform(0, 255, (BATCH, size, size, channels)).astype("float32")


def _labels(classes):
    return np.arange(BATCH) % classes


def application(name: str, size: int = 32, classes: int = 3) -> Callable[[], Case]:
    """A ``keras.applications`` model with random weights, ``size`` x ``size`` RGB inputs."""

    def build():
        make = getattr(keras.applications, name)
        model = make(weights=None, input_shape=(size, size, 3), classes=classes)
        return Case(model, _images(size), _labels(classes), "sparse_categorical_crossentropy")

    build.__name__ = name
    return build


def convnext_tiny(drop_path_rate: float = 0.1, size: int = 32, classes: int = 3) -> keras.Model:
    """ConvNeXt-Tiny with stochastic depth.

    ``keras.applications.ConvNeXtTiny`` fixes ``drop_path_rate=0.0`` (Keras 3.15);
    the same architecture with stochastic depth comes from the ConvNeXt builder
    it calls, with the tiny configuration.
    """
    from keras.src.applications.convnext import MODEL_CONFIGS, ConvNeXt

    config = MODEL_CONFIGS["tiny"]
    return ConvNeXt(depths=config["depths"], projection_dims=config["projection_dims"],
                    drop_path_rate=drop_path_rate, weights=None, include_top=True,
                    classes=classes, input_shape=(size, size, 3), name="convnext_tiny")


def convnext_case() -> Case:
    return Case(convnext_tiny(), _images(32), _labels(3), "sparse_categorical_crossentropy")


# -- The Keras-examples Transformer text classifier, as written there -------------------------
# (plus ``**kwargs`` passed to ``Layer``, which loading a saved model needs)


@keras.saving.register_keras_serializable(package="tfmp_zoo")
class TransformerBlock(layers.Layer):
    def __init__(self, embed_dim, num_heads, ff_dim, rate=0.1, **kwargs):
        super().__init__(**kwargs)
        self.att = layers.MultiHeadAttention(num_heads=num_heads, key_dim=embed_dim)
        self.ffn = keras.Sequential([layers.Dense(ff_dim, activation="relu"), layers.Dense(embed_dim)])
        self.layernorm1 = layers.LayerNormalization(epsilon=1e-6)
        self.layernorm2 = layers.LayerNormalization(epsilon=1e-6)
        self.dropout1 = layers.Dropout(rate)
        self.dropout2 = layers.Dropout(rate)

    def call(self, inputs):
        attn_output = self.att(inputs, inputs)
        attn_output = self.dropout1(attn_output)
        out1 = self.layernorm1(inputs + attn_output)
        ffn_output = self.ffn(out1)
        ffn_output = self.dropout2(ffn_output)
        return self.layernorm2(out1 + ffn_output)


@keras.saving.register_keras_serializable(package="tfmp_zoo")
class TokenAndPositionEmbedding(layers.Layer):
    def __init__(self, maxlen, vocab_size, embed_dim, **kwargs):
        super().__init__(**kwargs)
        self.token_emb = layers.Embedding(input_dim=vocab_size, output_dim=embed_dim)
        self.pos_emb = layers.Embedding(input_dim=maxlen, output_dim=embed_dim)

    def call(self, x):
        maxlen = ops.shape(x)[-1]
        positions = ops.arange(start=0, stop=maxlen, step=1)
        positions = self.pos_emb(positions)
        x = self.token_emb(x)
        return x + positions


def transformer_classifier(maxlen=8, vocab=50, embed_dim=8):
    inputs = layers.Input(shape=(maxlen,))
    x = TokenAndPositionEmbedding(maxlen, vocab, embed_dim)(inputs)
    x = TransformerBlock(embed_dim, 2, embed_dim)(x)
    x = layers.GlobalAveragePooling1D()(x)
    x = layers.Dropout(0.1)(x)
    x = layers.Dense(8, activation="relu")(x)
    outputs = layers.Dense(2, activation="softmax")(x)
    return keras.Model(inputs=inputs, outputs=outputs)


def transformer_case() -> Case:
    x = np.random.default_rng(0).integers(0, 50, (BATCH, 8)).astype("float32")  # float ids, as there
    return Case(transformer_classifier(), x, _labels(2), "sparse_categorical_crossentropy")


# -- A variational autoencoder whose KL term is an add_loss ----------------------------------


@keras.saving.register_keras_serializable(package="tfmp_zoo")
class Sampling(layers.Layer):
    """Draws z ~ N(mean, exp(log_var)) in training (the mean otherwise); adds the KL divergence."""

    def call(self, inputs, training=None):
        mean, log_var = inputs
        kl = -0.5 * ops.mean(1 + log_var - ops.square(mean) - ops.exp(log_var))
        self.add_loss(kl)
        if not training:
            return mean
        noise = keras.random.normal(ops.shape(mean), dtype=mean.dtype)
        return mean + ops.exp(0.5 * log_var) * noise


def vae_case(dim=16, latent=2) -> Case:
    inputs = keras.Input((dim,))
    h = layers.Dense(8, activation="relu")(inputs)
    z = Sampling()([layers.Dense(latent, name="mean")(h), layers.Dense(latent, name="log_var")(h)])
    decoded = layers.Dense(dim, activation="sigmoid", name="decoded")(layers.Dense(8, activation="relu")(z))
    x = np.random.default_rng(0).uniform(0, 1, (BATCH, dim)).astype("float32")
    return Case(keras.Model(inputs, decoded), x, x, "binary_crossentropy")


# -- Recurrent, 1-D convolutional and multi-output models -------------------------------------


def _sequences(steps=6, features=3):
    return np.random.default_rng(0).normal(size=(BATCH, steps, features)).astype("float32")


def bidirectional_lstm_case() -> Case:
    inputs = keras.Input((6, 3))
    x = layers.Bidirectional(layers.LSTM(8, return_sequences=True))(inputs)
    x = layers.Bidirectional(layers.LSTM(8))(x)
    model = keras.Model(inputs, layers.Dense(3, activation="softmax")(x))
    return Case(model, _sequences(), _labels(3), "sparse_categorical_crossentropy")


def gru_case() -> Case:
    model = keras.Sequential([keras.Input((6, 3)), layers.GRU(8), layers.Dense(1)])
    return Case(model, _sequences(), np.linspace(-1, 1, BATCH).astype("float32"), "mse")


def conv1d_batchnorm_case() -> Case:
    model = keras.Sequential([
        keras.Input((16, 3)), layers.Conv1D(8, 3), layers.BatchNormalization(), layers.ReLU(),
        layers.Conv1D(8, 3), layers.BatchNormalization(), layers.ReLU(),
        layers.GlobalAveragePooling1D(), layers.Dense(3, activation="softmax"),
    ])
    return Case(model, _sequences(16), _labels(3), "sparse_categorical_crossentropy")


def two_outputs_case() -> Case:
    inputs = keras.Input((6,))
    h = layers.Dense(16, activation="relu")(inputs)
    kind = layers.Dense(3, activation="softmax", name="kind")(h)
    size = layers.Dense(1, name="size")(h)
    model = keras.Model(inputs, {"kind": kind, "size": size})
    x = np.random.default_rng(0).normal(size=(BATCH, 6)).astype("float32")
    y = {"kind": _labels(3), "size": np.ones((BATCH, 1), "float32")}
    return Case(model, x, y, {"kind": "sparse_categorical_crossentropy", "size": "mse"})


# -- A subclassed model with its own train_step -----------------------------------------------


@keras.saving.register_keras_serializable(package="tfmp_zoo")
class CustomStep(keras.Model):
    """Two Dense layers, the last with a softmax; ``train_step`` scales the loss itself.

    ``self.optimizer.scale_loss`` multiplies the loss by the loss scale (a no-op
    for a plain optimizer); ``apply`` divides the gradients by it again.
    """

    def __init__(self, classes=3, **kwargs):
        super().__init__(**kwargs)
        self.classes = classes
        self.hidden = layers.Dense(16, activation="relu")
        self.head = layers.Dense(classes, activation="softmax")

    def call(self, x):
        return self.head(self.hidden(x))

    def train_step(self, data):
        x, y = data
        with tf.GradientTape() as tape:
            y_pred = self(x, training=True)
            loss = self.compute_loss(x=x, y=y, y_pred=y_pred)
            scaled = self.optimizer.scale_loss(loss)
        gradients = tape.gradient(scaled, self.trainable_variables)
        self.optimizer.apply(gradients, self.trainable_variables)
        return self.compute_metrics(x, y, y_pred)

    def get_config(self):
        return {**super().get_config(), "classes": self.classes}


def custom_step_case() -> Case:
    model = CustomStep()
    x = np.random.default_rng(0).normal(size=(BATCH, 6)).astype("float32")
    model(x[:1])
    return Case(model, x, _labels(3), "sparse_categorical_crossentropy")


#: name -> builder, in the order the tier runs them.
CASES: Dict[str, Callable[[], Case]] = {
    "resnet50": application("ResNet50"),
    "mobilenet_v2": application("MobileNetV2"),
    "efficientnet_b0": application("EfficientNetB0"),
    "densenet121": application("DenseNet121"),
    "convnext_tiny_drop_path": convnext_case,
    "transformer_classifier": transformer_case,
    "vae_add_loss": vae_case,
    "bidirectional_lstm": bidirectional_lstm_case,
    "gru": gru_case,
    "conv1d_batchnorm": conv1d_batchnorm_case,
    "two_outputs": two_outputs_case,
    "custom_train_step": custom_step_case,
}
