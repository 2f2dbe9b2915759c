"""A small Keras CNN with its own tf.data augmentation: an example TensorFlow workload, written only
against the platform's workload contract (the TensorFlow side), homogeneous or fed by tf.data.service.

    hetero local examples/workloads/keras_shapes/heterogeneous.json --channel train=DIR --channel validation=DIR
"""

import keras
import tensorflow as tf

HYPERPARAMETERS = {"image_size": 40, "width": 16}
LOOP_DEFAULTS = {"learning_rate": 0.003}  # the loop's setting: the job may override it
FILE_PATTERN = "*.jpg"


def build_dataset(files, ctx):  # TensorFlow ops only: tf.data.service's workers run this graph
    size = ctx.hyperparameters["image_size"]

    def load(file):
        image = tf.io.decode_jpeg(tf.io.read_file(file["path"]), channels=3)
        if ctx.training:  # a random crop of 60-100 % of the side, a flip, a brightness shift
            side = tf.cast(tf.cast(tf.reduce_min(tf.shape(image)[:2]), tf.float32) * tf.random.uniform((), 0.6, 1.0), tf.int32)
            image = tf.image.random_flip_left_right(tf.image.random_crop(image, tf.stack([side, side, 3])))
            image = tf.image.random_brightness(tf.cast(image, tf.float32), 25.0)
        image = tf.image.resize(tf.cast(image, tf.float32), (size, size))
        image = tf.cast(tf.clip_by_value(tf.round(image), 0, 255), tf.uint8)  # uint8 travels: a quarter of float32
        return {"image": tf.ensure_shape(image, (size, size, 3)), "label": file["label"]}

    return files.map(load, num_parallel_calls=tf.data.AUTOTUNE)


def build_model(ctx):
    size, width = ctx.hyperparameters["image_size"], ctx.hyperparameters["width"]
    layers = [keras.Input((size, size, 3))]
    for out in (width, 2 * width, 4 * width):
        layers += [keras.layers.Conv2D(out, 3, padding="same", use_bias=False), keras.layers.BatchNormalization(),
                   keras.layers.ReLU(), keras.layers.MaxPooling2D(2)]
    return keras.Sequential([*layers, keras.layers.GlobalAveragePooling2D(), keras.layers.Dense(len(ctx.classes))])


def build_optimizer(model, ctx):
    return keras.optimizers.Adam(ctx.learning_rate)


def logits_of(model, batch, training):
    return tf.cast(model(tf.cast(batch["image"], tf.float32) / 127.5 - 1.0, training=training), tf.float32)


def train_step(model, batch, ctx):
    logits = logits_of(model, batch, training=True)
    loss = keras.losses.sparse_categorical_crossentropy(batch["label"], logits, from_logits=True)
    hits = tf.cast(tf.equal(tf.argmax(logits, -1, output_type=tf.int32), batch["label"]), tf.float32)
    return tf.reduce_mean(loss), {"accuracy": tf.reduce_mean(hits)}


def eval_step(model, batch, ctx):
    logits = logits_of(model, batch, training=False)
    return {"loss": keras.losses.sparse_categorical_crossentropy(batch["label"], logits, from_logits=True),
            "accuracy": tf.cast(tf.equal(tf.argmax(logits, -1, output_type=tf.int32), batch["label"]), tf.float32)}
