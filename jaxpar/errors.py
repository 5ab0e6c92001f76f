"""The one exception type every user-facing failure raises.

The CLI turns a `JaxparError` into one line on stderr and exit code 2; library users catch it as a `ValueError`.
"""


class JaxparError(ValueError):
    """A bad input from the user: a flag, a config value, a mesh, a file. The message is one complete line."""


class MeshError(JaxparError):
    """A mesh spec that cannot be parsed or does not fit the available devices."""


class ConfigError(JaxparError):
    """A configuration value (CLI flag or config field) out of range or inconsistent with another."""


class ShardingError(JaxparError):
    """A sharding rule or model dimension that does not fit the mesh."""


class DataError(JaxparError):
    """A missing, empty or too small dataset, or a batch that cannot be trained on (no rows, ragged, not numeric,
    labels outside the model's classes)."""


class ModelError(JaxparError):
    """A model factory or loss function that breaks its contract (`rngs -> nnx.Module`;
    `(model, batch[, rngs]) -> (scalar loss, dict of metrics)`)."""


class StateError(JaxparError):
    """A train state that cannot be used: not a `TrainState`, or already donated to `Trainer.step`."""


class TrainingDiverged(JaxparError):
    """The loss became NaN or infinite: reported as one line, like a bad flag."""


class FitError(JaxparError):
    """`Trainer.fit` stopped early: the batch iterator ran out, a step was refused or an action raised.

    `.state` is the train state after `.step` updates (never donated, so training can go on from it); the original
    exception, if any, is `__cause__`.
    """

    def __init__(self, message: str, state=None, step: int | None = None):
        super().__init__(message)
        self.state, self.step = state, step


class Terminated(KeyboardInterrupt):
    """SIGTERM, raised in the main thread like Ctrl-C's KeyboardInterrupt (run.py), so the run ends the same way."""


class ResourceError(JaxparError):
    """The run does not fit the devices (memory), refused before allocating or reported at once, never a hang."""
