"""LeNet-5 on MNIST (hub) or on scikit-learn's bundled handwritten digits (offline default)."""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F
from omegaconf import DictConfig
from torch import nn

from bench.data import hub
from bench.tasks.base import Task, built_on


class LeNet5(nn.Sequential):
    """conv 6@5x5 -> 2x2 max-pool -> conv 16@5x5 -> 2x2 max-pool -> fc 120 -> 84 -> 10, ReLU; 32x32 input.

    Built from modules only (no functional calls), so precision and unit-scaling transforms can swap them.
    """

    def __init__(self, num_classes: int = 10):
        super().__init__(
            nn.Conv2d(1, 6, 5), nn.ReLU(), nn.MaxPool2d(2),
            nn.Conv2d(6, 16, 5), nn.ReLU(), nn.MaxPool2d(2),
            nn.Flatten(),
            nn.Linear(16 * 5 * 5, 120), nn.ReLU(),
            nn.Linear(120, 84), nn.ReLU(),
            nn.Linear(84, num_classes),
        )


def _standardise(train: torch.Tensor, test: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    mean, std = train.mean(), train.std()
    return (train - mean) / std, (test - mean) / std


def load_digits(test_fraction: float) -> tuple[torch.Tensor, ...]:
    """sklearn's 1,797 8x8 digits, bilinearly upsampled to 32x32, fixed stratified train/test split
    (random_state=0); the validation split is carved from train (see split_validation)."""
    from sklearn.datasets import load_digits as sk_digits
    from sklearn.model_selection import train_test_split

    digits = sk_digits()
    images = torch.tensor(digits.images, dtype=torch.float32).unsqueeze(1) / 16.0
    images = F.interpolate(images, size=(32, 32), mode="bilinear", align_corners=False)
    labels = torch.tensor(digits.target, dtype=torch.long)
    idx_train, idx_test = train_test_split(np.arange(len(labels)), test_size=test_fraction, random_state=0,
                                           stratify=digits.target)
    x_train, x_test = _standardise(images[idx_train], images[idx_test])
    return x_train, labels[idx_train], x_test, labels[idx_test]


def split_validation(x: torch.Tensor, y: torch.Tensor, fraction: float) -> tuple[torch.Tensor, ...]:
    """A fixed validation split of the training set (random_state=0), for every choice made while building the
    task (augmentation, epochs), so that the test set is never used for one. Stratified by label wherever the
    split can hold every label (not in a few-dozen-image fixture)."""
    from sklearn.model_selection import train_test_split

    if fraction <= 0:
        return x, y, x[:0], y[:0]
    labels = y.numpy()
    counts = np.bincount(labels)
    stratifiable = counts[counts > 0].min() >= 2 and round(fraction * len(labels)) >= (counts > 0).sum()
    idx_train, idx_val = train_test_split(np.arange(len(y)), test_size=fraction, random_state=0,
                                          stratify=labels if stratifiable else None)
    return x[idx_train], y[idx_train], x[idx_val], y[idx_val]


def load_mnist(name: str) -> tuple[torch.Tensor, ...]:
    """MNIST through `datasets` (hub schema: PIL `image`, int `label`), resized to 32x32 as MindSpore does."""
    import datasets

    splits = datasets.load_dataset(name)

    def tensors(split):
        images = torch.tensor(np.stack([np.asarray(im, dtype=np.uint8) for im in split["image"]]))
        images = F.interpolate(images.unsqueeze(1).float() / 255.0, size=(32, 32), mode="bilinear",
                               align_corners=False)
        return images, torch.tensor(split["label"], dtype=torch.long)

    x_train, y_train = tensors(splits["train"])
    x_test, y_test = tensors(splits["test"])
    x_train, x_test = _standardise(x_train, x_test)
    return x_train, y_train, x_test, y_test


def lenet_task(cfg: DictConfig, device: torch.device, seed: int) -> Task:
    batch_size = cfg.batch_size
    if cfg.data.source == "digits":
        x_train, y_train, x_test, y_test = load_digits(cfg.data.test_fraction)
    else:
        hub.require(data=[cfg.data.name])
        x_train, y_train, x_test, y_test = load_mnist(cfg.data.name)
    x_train, y_train, x_val, y_val = split_validation(x_train, y_train, cfg.data.val_fraction)
    background = float(x_train.min())  # read here, on the host: on a device every read is a transfer
    x_train, y_train, x_val, y_val, x_test, y_test = (t.to(device) for t in (x_train, y_train, x_val, y_val,
                                                                             x_test, y_test))
    model = built_on(device, LeNet5)
    n_batches = len(y_train) // batch_size  # drop_last: every step sees a full batch

    shift = cfg.data.augment_shift

    def train_batches(epoch: int):
        generator = torch.Generator().manual_seed(seed * 100_003 + epoch)
        order = torch.randperm(len(y_train), generator=generator)
        for b in range(n_batches):
            idx = order[b * batch_size:(b + 1) * batch_size].to(device)
            x = x_train[idx]
            if shift:
                # the window is gathered by index tensors, not sliced: on XLA each of the 25 slices would be a graph
                # of its own to compile, a gather is one (the values are the slice's). Two fresh index tensors each
                # step: reusing one per offset made dx == dy a graph with one input fewer, compiled anew
                dx, dy = torch.randint(-shift, shift + 1, (2,), generator=generator).tolist()
                x = F.pad(x, (shift, shift, shift, shift), value=background)
                window = torch.arange(32)
                x = (x.index_select(-2, (window + shift + dy).to(device))
                     .index_select(-1, (window + shift + dx).to(device)))
            yield x, y_train[idx]

    def forward(model, batch, cast_inputs):
        x, y = batch
        return model(cast_inputs(x)).float(), y

    @torch.no_grad()
    def accuracy(model, cast_inputs, x, y) -> float:
        correct = 0
        for start in range(0, len(y), 1024):
            logits = model(cast_inputs(x[start:start + 1024]))
            correct += (logits.argmax(1) == y[start:start + 1024]).sum().item()
        return correct / len(y)

    def evaluate(model, cast_inputs) -> dict:
        metrics = {"test_accuracy": accuracy(model, cast_inputs, x_test, y_test), "test_examples": len(y_test)}
        if len(y_val):
            metrics |= {"val_accuracy": accuracy(model, cast_inputs, x_val, y_val), "val_examples": len(y_val)}
        return metrics

    def validate(model, cast_inputs) -> dict:
        """The validation split's accuracy after each epoch: the quality curve (never the test set)."""
        return {"val_accuracy": accuracy(model, cast_inputs, x_val, y_val)} if len(y_val) else {}

    return Task(model=model, train_batches=train_batches, forward=forward,
                loss=lambda logits, y, cross_entropy: cross_entropy(logits, y), evaluate=evaluate,
                batch_size=batch_size, steps_per_epoch=n_batches, validate=validate)
