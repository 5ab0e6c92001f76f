"""MLP on scikit-learn's digits, data parallel over 8 devices."""

from jaxpar.cli import Config


def get_config() -> Config:
    return Config(model="mlp", mesh="8", steps=300, batch_size=64, lr=3e-3, dropout=0.0, hidden=128)
