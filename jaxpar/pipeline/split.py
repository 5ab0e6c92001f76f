"""A pipelined model's training step: the loss cut at the model's one `Stack`, so that the part before the stack
runs on the first stage and the part after it (and the loss) on the last, one microbatch per tick, inside the
schedule (GPipe, circular, 1F1B), as Megatron and DeepSpeed run the embedding and the head.

Nothing of the user's model or loss changes. The loss function is traced three ways, the stack's `tap` standing in
for its layers:
- `Capture` on the whole batch, outside the stages: what the stack is called with (its extra arguments, its dropout
  key, the input's shape) and the model's new non-parameter state; the stack input itself and everything after it
  are dead code, compiled away, so nothing of the whole batch is computed outside the schedule;
- `Capture` on microbatch m, inside the first stage's tick: the stack input of that microbatch (`first`);
- `Replace` on microbatch m, inside the last stage's tick: the loss with the stack returning the stages' output
  (`head`; the part before the stack is dead code).
`jaxpar.pipeline.staged_loss` runs them in the schedules.

Dropout outside the stack: microbatch m's traces draw with a key of `jaxpar.pipeline.shard_keys` that gives the whole
batch's masks at the microbatch's rows (rows m, m + M, ...), so the part before and after the stack draws what it
draws on one device; the stacked layers draw per microbatch as everywhere (`jaxpar.pipeline.stack`).

The step's loss and metrics are their means over microbatches (and over data shards, each stage map running its own
rows), which equal the whole batch's for a loss and metrics that are means over examples (as under gradient
accumulation). A model that calls its stack more than once, or has several, keeps GPipe's and circular's plain step
(the stack pipelined inside the autodiff of the whole loss); 1F1B refuses it.
"""

from __future__ import annotations

import jax
from flax import nnx

from jaxpar.errors import ModelError
from jaxpar.parallel import mesh as mesh_lib
from jaxpar.parallel import partitioning as shd
from jaxpar.pipeline import shard_keys
from jaxpar.pipeline.stack import Stack, split_microbatches


def the_stack(model, strict: bool = True) -> tuple[tuple, Stack] | None:
    """(path, module) of the model's one Stack; a ModelError names what 1F1B needs otherwise (None if not
    `strict`)."""
    found = [(path, node) for path, node in nnx.iter_graph(model) if isinstance(node, Stack)]
    if len(found) != 1:
        if not strict:
            return None
        what = "no jaxpar.pipeline.Stack" if not found else f"{len(found)} jaxpar.pipeline.Stack modules"
        raise ModelError(f"--pipeline 1f1b: the model has {what}; 1F1B pipelines exactly one stack of blocks (use "
                         f"--pipeline gpipe or circular for several)")
    return found[0]


class Capture:
    """A stack's tap that records what the layers are called with and returns their input. `strict`: a second call
    is a ModelError (else counted in `calls`)."""

    def __init__(self, strict: bool = True):
        self.x = self.args = self.key = None
        self.strict, self.calls = strict, 0

    def __call__(self, stack, x, args, key):
        self.calls += 1
        if self.calls > 1 and self.strict:  # its input would overwrite the first's, its output be wrong
            raise ModelError("--pipeline 1f1b (Pipeline('1f1b')): the model calls its jaxpar.pipeline.Stack more "
                             "than once per step; 1F1B pipelines one pass through one stack (use --pipeline "
                             "gpipe or circular, which pipeline every call)")
        if self.calls == 1:
            self.x, self.args, self.key = x, args, key
        return x


class Replace:
    """A stack's tap that returns `output` (the layers' output, computed by the stages)."""

    def __init__(self, output):
        self.output = output

    def __call__(self, stack, x, args, key):
        return self.output


def tapped(model, tap):
    """`model` (a merged copy) with its one stack's tap set to `tap`: (the stack, the tap)."""
    stack = the_stack(model)[1]
    stack.tap = tap
    return stack, tap


def cut(graphdef, loss_of, params, model_state, batch, key, strict: bool):
    """The whole batch's trace with the stack recording its call: (path, stack, Capture, new model_state), or None
    when not `strict` and the model has not exactly one stack called once."""
    model = nnx.merge(graphdef, params, model_state)
    found = the_stack(model, strict)
    if found is None:
        return None
    path, stack = found
    capture = Capture(strict)
    stack.tap = capture
    loss_of(model, batch, key)
    stack.tap = None
    if capture.calls != 1:
        if strict:
            raise ModelError("--pipeline 1f1b (Pipeline('1f1b')): the loss never calls the model's "
                             "jaxpar.pipeline.Stack; 1F1B pipelines one pass through one stack (use --pipeline gpipe)")
        return None
    return path, stack, capture, nnx.split(model, nnx.Param, ...)[2]


def _head_inputs(mesh, micro, y):
    """The microbatch and the stack's output as the head sees them on the last stage.

    With the batch split (data or fsdp > 1) and a model axis > 1, leaving their rows split inside the stage-manual
    shard_map crashes XLA's SPMD partitioner for a head with a tensor-parallel vocabulary (jax 0.10.2: "Check
    failed: partition_group_list..."; `python run.py --mesh data=2,stage=2,model=2 --pipeline 1f1b` aborted).
    Replicating both over the stage's devices avoids it: every device of the last stage then computes the head on
    the whole microbatch (the head's compute is not split over the batch axes; the stages' layers still are)."""
    if mesh_lib.size(mesh, mesh_lib.BATCH_AXES) > 1 and mesh_lib.size(mesh, mesh_lib.TENSOR_AXIS) > 1:
        return shd.replicate_within(micro), shd.replicate_within(y)
    return micro, y


def model_parts(graphdef, loss_of, stack_params, state, batch, step_key, count: int, mesh, rows_axis):
    """Inside a stage map: (`first(other, m) -> x`, `head(other, y, m) -> (loss, metrics)`) on this device's rows of
    microbatch m of `batch` (its rows of the whole batch), `other` being the parameters outside the stack."""
    rows = jax.tree.leaves(batch)[0].shape[0] // count
    start = 0 if rows_axis is None else jax.lax.axis_index(rows_axis) * rows * count

    def micro(m):
        return jax.tree.map(lambda a: split_microbatches(a, count)[m], batch)

    def key_of(m):  # the whole batch's draws at microbatch m's rows: start + m, start + m + M, ...
        return shard_keys.shard_key(jax.random.wrap_key_data(step_key), start + m, rows, count)

    def model_of(other):
        return nnx.merge(graphdef, nnx.merge_state(other, stack_params), state)

    def first(other, m):
        model = model_of(other)
        _, capture = tapped(model, Capture())
        loss_of(model, micro(m), key_of(m))
        return capture.x

    def head(other, y, m):
        model = model_of(other)
        batch_m, y = _head_inputs(mesh, micro(m), y)
        tapped(model, Replace(y))
        return loss_of(model, batch_m, key_of(m))

    return first, head
