"""The one exception type every user-facing failure raises.

The CLI turns a `JaxparError` into one line on stderr and exit code 2; library users catch it as a `ValueError`.
"""

import re


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


class ModelCallError(ModelError):
    """The user's model or loss function raised while a step or an evaluation was traced: one line with the step and
    the batch's shapes (when the trainer knows them); the original exception is `__cause__`."""


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


class OptionError(ConfigError):
    """A bad value of one option, said as the library argument (`staleness=20000: ...`); the command line says the
    same thing with its flag (`--staleness 20000: ...`), see `cli_message`.

    `why` may name other options as `{name}` fields: `"applies only with {allreduce} torus2d"`.
    """

    def __init__(self, option: str, value, why: str, flag: str | None = None):
        self.option, self.value, self.why = option, value, why
        self.flag = flag or "--" + option.replace("_", "-")
        super().__init__(f"{option}={value!r}: {_named(why, False)}")

    def as_flag(self) -> str:
        shown = self.value if isinstance(self.value, (int, float)) else repr(self.value)
        return f"{self.flag} {shown}: {_named(self.why, True)}"

    def __reduce__(self):  # pickled whole (a Ray actor hands one to the driver), whatever the subclass's __init__
        return _rebuilt, (type(self), self.args, dict(self.__dict__))


def _rebuilt(cls, args, state):
    error = cls.__new__(cls)
    Exception.__init__(error, *args)
    error.__dict__.update(state)
    return error


def _named(text: str, as_flags: bool) -> str:
    """`{option_name}` -> `--option-name` (flags) or `option_name`; any other text, braces included, unchanged."""
    return re.sub(r"\{([a-z][a-z_]*)\}", lambda m: ("--" + m[1].replace("_", "-")) if as_flags else m[1], text)


def cli_message(error: BaseException) -> str:
    """How the command line states `error`: options by their flags, even inside a `FitError`."""
    cause = error if isinstance(error, OptionError) else getattr(error, "__cause__", None)
    return cause.as_flag() if isinstance(cause, OptionError) else str(error)


class ReplicaMismatch(JaxparError):
    """Copies of a replicated parameter differ between devices (checked by `jaxpar.train.faults.ReplicaCheck`)."""


class CheckpointError(OptionError):
    """A checkpoint folder or checkpoint that cannot be used: missing, corrupt, or of another model / config.
    Said of the folder: `checkpoint_dir='ckpt': ...` (the command line: `--checkpoint-dir 'ckpt': ...`)."""

    def __init__(self, directory: str, why: str):
        super().__init__("checkpoint_dir", directory, why)


class Preempted(KeyboardInterrupt):
    """A stop was requested (SIGTERM / SIGINT with checkpoints on): the checkpoint of `.step` is saved."""

    def __init__(self, step: int):
        super().__init__(step)
        self.step = step
