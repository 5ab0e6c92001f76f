"""CNN with BatchNorm on scikit-learn's digits, 4-way data x 2-way model parallel."""

from jaxpar.cli import Config


def get_config() -> Config:
    return Config(model="cnn", mesh="4x2", steps=300, batch_size=64, lr=3e-3, dropout=0.0)
