"""`python run.py --runtime ray`: the config's model, loss, optimizer, strategy and data handed to
`jaxpar.runtime.ray.run` (each data-axis index a worker process, a parameter server), its progress as versions per
second and staleness, its records as the --metrics JSONL (`step` = server version, `wall_time` in seconds) and
--tensorboard scalars, and `--explain`'s account of the workers, their devices and the bytes each push and pull
moves."""

from __future__ import annotations

import json
import math
import os
import time

import numpy as np

import models
from jaxpar.cli import strategies
from jaxpar.cli.batching import static_batch_sizes
from jaxpar.cli.build import datasets, make_optimizer
from jaxpar.errors import CheckpointError
from jaxpar.io.metrics import EVAL_PREFIX
from jaxpar.parallel import mesh as mesh_lib
from jaxpar.train.lr_schedules import batch_size_fn, lr_schedule


class CliBatches:
    """(worker, num_workers, seq) -> the worker's rows of the run's global batch number `seq` (the emulated run's
    batch of step `seq`, split over the data axis as the emulation splits it). Built in each worker process."""

    def __init__(self, config):
        self.config, self._batches = config, None

    def __call__(self, worker: int, workers: int, seq: int) -> dict:
        size = self.config.batch_size
        if self._batches is None:
            self._batches = datasets(self.config, batch_size_fn(size, None), size)[0]
        per = size // workers
        self._batches.rows = lambda n: np.arange(worker * per, (worker + 1) * per)
        self._batches.set_state({"position": seq * size, "step": seq})
        return next(self._batches)


def _parts(config):
    shape = mesh_lib.parse_mesh_spec(config.mesh)
    schedule = lr_schedule(config.lr, config.steps, scaling=config.lr_scaling, base_batch_size=config.base_batch_size,
                           batch_at=lambda step: config.batch_size, warmup_steps=config.warmup_steps,
                           schedule=config.lr_schedule, decay_steps=config.decay_steps(),
                           decay_factor=config.lr_decay_factor)
    return shape, make_optimizer(config, schedule), strategies.from_config(config)


def train_on_ray(config) -> dict:
    """The run (config validated and resolved); a summary like the emulated run's."""
    from jaxpar.runtime.ray import run
    from jaxpar.runtime.ray.connect import check_address, ray_module

    static_batch_sizes(config)
    ray_module()  # installed?
    if config.ray_address:
        check_address(config.ray_address)
    if config.resume == "required" and not _has_checkpoint(config.checkpoint_dir):
        raise CheckpointError(config.checkpoint_dir, "holds no server checkpoint to resume (--resume required); "
                                                     "pass --resume to start fresh when there is none")
    shape, optimizer, strategy = _parts(config)
    if (config.server_shards or 1) > 1:  # more shards than arrays: one line before Ray starts
        from jaxpar.runtime.ray.shards import split_by_bytes

        split_by_bytes(_sizes(config), config.server_shards)
    if config.explain:
        return explain_ray(config, shape, strategy)
    workers, devices = shape[0], math.prod(shape[1:])
    print(f"jaxpar: {config.model} on --runtime ray: {workers} worker processes of {devices} device"
          f"{'s' * (devices > 1)} each (mesh {config.mesh}) and a parameter server"
          f"{f' split over {config.server_shards} shards' if (config.server_shards or 1) > 1 else ''}; global batch "
          f"{config.batch_size} ({config.batch_size // workers} per worker); strategy {config.strategy}; "
          f"{config.steps} server updates", flush=True)
    if config.eval_every:
        print(f"jaxpar: note: --eval-every {config.eval_every}: --runtime ray evaluates the server's final "
              f"parameters only, at the end (the workers never hold one version all at once)", flush=True)
    last = {}

    def progress(p):  # versions per second since the last line (the first: since the first update's clock)
        if not p["version"]:
            return  # workers still compiling
        now = time.time()
        rate = ((p["version"] - last["version"]) / max(now - last["at"], 1e-9) if last
                else p["version"] / max(p["wall"], 1e-9))
        last.update(version=p["version"], at=now)
        print(f"version {p['version']}/{config.steps}  {rate:.1f} versions/s  loss {p['loss']:.4g}  staleness mean "
              f"{p['staleness_mean']:.2f} max {p['staleness_max']}  workers {len(p['alive'])}", flush=True)

    run_dir = os.path.splitext(config.metrics)[0] + "-ray" if config.metrics else None
    out = run(models.factory(config), models.loss_for(config), optimizer, shape, strategy, CliBatches(config),
              config.steps, seed=config.seed, grad_accum=config.grad_accum,
              skip_nonfinite=config.on_nonfinite == "skip", rules=config.rules, ray_address=config.ray_address,
              max_restarts=config.max_restarts or 0, run_dir=run_dir, on_progress=progress,
              checkpoint_dir=config.checkpoint_dir, checkpoint_every=config.checkpoint_every,
              resume=config.resume is not None, server_shards=config.server_shards or 1,
              progress_every=2.0)
    records = [{"step": r["version"], "loss": r["loss"], "wall_time": r["wall"], "staleness_mean": r["staleness_mean"],
                "staleness_max": r["staleness_max"], "contributors": r["contributors"]} for r in out.records]
    held = evaluate_final(config, optimizer, out.params) if config.eval_batches else {}
    written = [{**config.to_record(), "runtime_dir": out.run_dir}] + records
    if held:
        print(f"held-out at step {out.version}: " + "  ".join(f"{k} {v:.4g}" for k, v in held.items()), flush=True)
        written.append({"step": out.version, **{EVAL_PREFIX + k: v for k, v in held.items()}})
    if config.metrics:
        with open(config.metrics, "w", encoding="utf-8") as handle:
            for record in written:
                handle.write(json.dumps(record) + "\n")
    if config.tensorboard:
        from jaxpar.io.tensorboard import TensorBoardFile

        board = TensorBoardFile(config.tensorboard)
        for record in written:
            board.write(record)
        board.close()
    stale = [r["staleness_max"] for r in out.records]
    print(f"jaxpar: {out.version} versions in {out.seconds:.1f}s ({out.version / max(out.seconds, 1e-9):.1f} "
          f"versions/s); final loss {records[-1]['loss']:.4g}; staleness max {max(stale)}; worker restarts "
          f"{sum(out.restarts.values())}; records in {out.run_dir}", flush=True)
    return {"final_loss": records[-1]["loss"], "steps": out.version, "seconds": out.seconds,
            "steps_per_sec": out.version / max(out.seconds, 1e-9), "staleness_max": max(stale),
            "restarts": sum(out.restarts.values()), **{EVAL_PREFIX + k: v for k, v in held.items()}}


def evaluate_final(config, optimizer, params) -> dict[str, float]:
    """The emulated run's held-out evaluation (`jaxpar.cli.evaluation.evaluate`) of the server's final parameters, on
    this process's devices (as many as the batch axes of a one-worker mesh need: one)."""
    import jax
    from flax import nnx

    from jaxpar import Trainer
    from jaxpar.cli.evaluation import evaluate

    trainer = Trainer(models.factory(config), models.loss_for(config), optimizer,
                      mesh_lib.make_mesh("data=1", devices=jax.devices()[:1]), rules=config.rules)
    state = trainer.init(config.seed)
    values = nnx.State(state.params)
    nnx.replace_by_pure_dict(values, params)
    state = state._replace(params=jax.device_put(values, trainer.state_shardings.params))
    held_out = datasets(config, batch_size_fn(config.batch_size, None), config.batch_size)[1]
    return evaluate(trainer, state, held_out, config.batch_size, config)


def _has_checkpoint(folder: str) -> bool:
    return os.path.isdir(folder) and any(name.isdigit() for name in os.listdir(folder))


def _sizes(config) -> list[int]:
    """Bytes of each parameter array of the configured model (traced abstractly)."""
    import jax
    from flax import nnx

    with nnx.use_eager_sharding(False):
        abstract = nnx.eval_shape(lambda: models.factory(config)(nnx.Rngs(0)))
    return [x.size * x.dtype.itemsize for x in jax.tree.leaves(nnx.state(abstract, nnx.Param))]


def explain_ray(config, shape, strategy) -> dict:
    """What a ray run would be: its workers and their devices, the bytes of each push and pull, and the
    emulator's projection for the straggler profile (simulated time of this strategy against BSP, on the real
    server's terms: each push its own arrival; unit compute, free round trips)."""
    import jax
    from flax import nnx

    from jaxpar.runtime.ray.spec import server_rule
    from jaxpar.strategies.simulation import simulate_server

    sizes = _sizes(config)
    nbytes = sum(sizes)
    bound, period, _ = server_rule(strategy)
    workers, stragglers = shape[0], strategy.stragglers
    updates = min(config.steps, 10_000)
    mine = simulate_server(stragglers, workers, None if math.isinf(bound) else int(bound), updates)[-1].sim_time
    bsp = simulate_server(stragglers, workers, 0, updates)[-1].sim_time
    lines = [f"runtime ray: {workers} workers (ReplicaWorker actors), each on mesh "
             f"{','.join(f'{a}={s}' for a, s in zip(mesh_lib.AXES, (1, *shape[1:])))} "
             f"({math.prod(shape[1:])} devices), and one ParameterServer",
             f"each push sends {nbytes:,} bytes ({'a gradient' if period == 1 else f'the change of {period} local steps'}"
             f"), each pull receives {nbytes:,} bytes of parameters (float32 numpy through Ray's object store)",
             f"emulator's projection for {updates} updates with stragglers '{stragglers.spec or 'none'}': simulated "
             f"time {mine:g} against {bsp:g} for BSP (ratio {mine / bsp:.3f})"]
    shards = config.server_shards or 1
    if shards > 1:
        from jaxpar.runtime.ray.shards import split_by_bytes

        held = [sum(sizes[i] for i in part) for part in split_by_bytes(sizes, shards)]
        lines.insert(1, f"the server's parameters split over {shards} ParameterServerShard actors by bytes: "
                        f"{', '.join(f'{b:,}' for b in held)} bytes; each push sends each shard its part and each "
                        f"pull reads it back, so the largest moves {max(held):,} bytes per push and per pull")
    for line in lines:
        print(line)
    return {"explain": lines, "push_bytes": nbytes, "projected_ratio": mine / bsp}
