"""The tensorflow variant's built-in image classifier, written against the TensorFlow workload contract
(training/workload/tf_contract.py) as a user's module is: ResNet50 (keras.applications, untrained) or a
small CNN, the augmentation of training/data_service/tf_pipeline.py, normalisation inside the step.

Its settings are KerasVisionConfig's (training/trainers/config.py), which the spec validates.
"""

import keras
import tensorflow as tf

HYPERPARAMETERS = {"model": "resnet50", "cnn_width": 32, "image_size": 128, "augment": "standard"}
# ImageNet statistics, applied in the compiled step to the uint8 batches.
MEAN = (0.485, 0.456, 0.406)
STD = (0.229, 0.224, 0.225)


def build_dataset(files, ctx):
    from training.data_service.augmentation import AugmentConfig
    from training.data_service.tf_pipeline import augmented

    return augmented(files, AugmentConfig(image_size=ctx.hyperparameters["image_size"], augment=ctx.hyperparameters["augment"]))


def build_model(ctx):
    size = ctx.hyperparameters["image_size"]
    shape, classes = (size, size, 3), len(ctx.classes)
    if ctx.hyperparameters["model"] == "resnet50":
        return keras.applications.ResNet50(weights=None, input_shape=shape, classes=classes, classifier_activation=None)
    layers = [keras.Input(shape)]
    for stage in range(3):
        width = ctx.hyperparameters["cnn_width"] * 2**stage
        for _ in range(2):
            layers += [keras.layers.Conv2D(width, 3, padding="same", use_bias=False), keras.layers.BatchNormalization(), keras.layers.ReLU()]
        layers.append(keras.layers.MaxPooling2D(2))
    layers += [keras.layers.GlobalAveragePooling2D(), keras.layers.Dense(classes)]
    return keras.Sequential(layers, name="small_cnn")


def normalise(images):
    return (tf.cast(images, tf.float32) / 255.0 - tf.constant(MEAN)) / tf.constant(STD)


def train_step(model, batch, ctx):
    images, labels = batch
    logits = tf.cast(model(normalise(images), training=True), tf.float32)
    return tf.reduce_mean(keras.losses.sparse_categorical_crossentropy(labels, logits, from_logits=True))


def eval_step(model, batch, ctx):
    images, labels = batch
    logits = tf.cast(model(normalise(images), training=False), tf.float32)
    return {"loss": keras.losses.sparse_categorical_crossentropy(labels, logits, from_logits=True),
            "accuracy": tf.cast(tf.equal(tf.argmax(logits, -1, output_type=tf.int32), tf.cast(labels, tf.int32)), tf.float32)}
