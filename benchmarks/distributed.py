"""Several processes: jaxpar's data-parallel step against PyTorch DistributedDataParallel, and 1 process x 8 devices
against 2 processes x 4 devices on the default transformer.

    pip install torch==2.13.0          # benchmark only (`pip install -e '.[bench]'`); never a jaxpar dependency
    python -m benchmarks.distributed ddp --rounds 5 --steps 30
    python -m benchmarks.distributed allreduce --rounds 5 --steps 30
    python -m benchmarks.distributed flatten --rounds 5 --steps 30
    python -m benchmarks.distributed processes --rounds 2 --steps 40

`ddp`: 2 processes x 1 CPU device, each process both a JAX process (jax.distributed, gloo) and a torch process
(torch.distributed, gloo). The same model (256-1024-10, GELU), global batch 512 (256 rows per process), AdamW
(lr 1e-3), cross-entropy. Rounds alternate in the same two processes (jaxpar, torch, jaxpar, ...), so machine noise
hits both alike; each round is --steps steps timed to the end of its last update. Both use one compute thread per
process (XLA: no Eigen multithreading; torch.set_num_threads(1)): 2 processes on 2 cores. Five contenders: jaxpar
(the default Trainer: the compiler's step), jaxpar with Sync("psum") (the explicit step: one flat buffer), torch DDP, the hand-written `jax.jit` step (the compiler inserts the gradient all-reduce) and
a hand-written one-buffer step (shard_map, gradients and loss raveled into one buffer, one pmean). Prints the median
samples/s of each and jaxpar's ratio to each, and one JSON line.

`allreduce`: the bare all-reduce between the same 2 processes, XLA against torch (4 B and the MLP's 1.1 MB), and
XLA's all-reduce of the MLP's 5 gradient arrays against the same bytes as one array (ms per call).

`flatten`: one process: the MLP's gradients left as they are, concatenated into one buffer, or written into one
buffer in place as jaxpar does (ms per call).

`--xla-flags`: more XLA flags for every JAX step of these (the options measured in docs/processes.md).

`processes`: `python run.py --mesh 2x4` (1 process, 8 devices) against `python -m jaxpar.launch --nproc 2 -- run.py
--mesh 2x4` (2 processes x 4 devices), alternating, each --steps steps of the default transformer; samples/s is the
mean of the JSONL records after the first 10 steps (compilation left out).
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

GLOBAL_BATCH, IN, HIDDEN, OUT = 512, 256, 1024, 10
EXTRA_FLAGS = "JAXPAR_BENCH_XLA_FLAGS"  # --xla-flags, passed to the workers (a later flag overrides an earlier one)


def ddp_worker(rank: int, port: int, torch_port: int, rounds: int, steps: int, out: str) -> None:
    os.environ["XLA_FLAGS"] = f"--xla_cpu_multi_thread_eigen=false {os.environ.get(EXTRA_FLAGS, '')}".strip()
    import jaxpar

    jaxpar.runtime.distributed.initialize(f"127.0.0.1:{port}", 2, rank, local_devices=1)
    import jax
    import numpy as np
    import optax
    import torch
    import torch.distributed as dist
    from flax import nnx
    from torch.nn.parallel import DistributedDataParallel

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{torch_port}", rank=rank, world_size=2)

    class MLP(nnx.Module):  # a user's own model: no sharding annotations (pure data parallelism)
        def __init__(self, rngs):
            self.hidden = nnx.Linear(IN, HIDDEN, rngs=rngs)
            self.out = nnx.Linear(HIDDEN, OUT, rngs=rngs)

        def __call__(self, x):
            return self.out(jax.nn.gelu(self.hidden(x), approximate=False))

    def loss_fn(model, batch):
        logits = model(batch["x"])
        return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean(), {}

    trainer = jaxpar.Trainer(model=MLP, loss_fn=loss_fn, optimizer=optax.adamw(1e-3), mesh=jaxpar.make_mesh("2"))
    rng = np.random.default_rng(rank)
    local = GLOBAL_BATCH // 2
    batch = {"x": rng.standard_normal((local, IN), dtype=np.float32),
             "y": rng.integers(0, OUT, local).astype(np.int32)}
    assert list(trainer.local_rows(GLOBAL_BATCH)) == list(range(rank * local, (rank + 1) * local))
    state = trainer.init(0)
    psum_trainer = jaxpar.Trainer(model=MLP, loss_fn=loss_fn, optimizer=optax.adamw(1e-3),
                                  mesh=jaxpar.make_mesh("2"), strategy=jaxpar.Sync("psum"))
    psum_state = psum_trainer.init(0)

    model = DistributedDataParallel(torch.nn.Sequential(torch.nn.Linear(IN, HIDDEN), torch.nn.GELU(),
                                                        torch.nn.Linear(HIDDEN, OUT)))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=1e-4)  # optax.adamw's default decay
    x, y = torch.from_numpy(batch["x"]), torch.from_numpy(batch["y"].astype(np.int64))

    def jax_round(n):
        nonlocal state
        for _ in range(n):
            state, metrics = trainer.step(state, batch)
        return float(metrics["loss"])

    def psum_round(n):  # the explicit per-replica step: gradients and loss as one flat buffer
        nonlocal psum_state
        for _ in range(n):
            psum_state, metrics = psum_trainer.step(psum_state, batch)
        return float(metrics["loss"])

    def torch_round(n):
        for _ in range(n):
            optimizer.zero_grad(set_to_none=True)
            loss = torch.nn.functional.cross_entropy(model(x), y)
            loss.backward()
            optimizer.step()
        return float(loss.detach())

    # a hand-written jit step on the same mesh (what XLA + gloo give without jaxpar): replicated params and AdamW
    # state, the batch split over the two processes; the compiler inserts the gradient all-reduce
    from jax.sharding import NamedSharding, PartitionSpec as P

    tx = optax.adamw(1e-3)
    graphdef, params = nnx.split(MLP(nnx.Rngs(0)), nnx.Param)
    replicated, rows = NamedSharding(trainer.mesh, P()), NamedSharding(trainer.mesh, P(("data", "fsdp")))
    params = jax.device_put(params, replicated)
    opt_state = jax.device_put(tx.init(params), replicated)

    @jax.jit
    def hand_step(params, opt_state, batch):
        def loss(p):
            return loss_fn(nnx.merge(graphdef, p), batch)[0]

        value, grads = jax.value_and_grad(loss)(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, value

    placed = {k: jax.make_array_from_process_local_data(rows, v, (GLOBAL_BATCH,) + v.shape[1:])
              for k, v in batch.items()}

    def hand_round(n):
        nonlocal params, opt_state
        for _ in range(n):
            placed_now = {k: jax.make_array_from_process_local_data(rows, v, (GLOBAL_BATCH,) + v.shape[1:])
                          for k, v in batch.items()}  # a new batch every step, as the others take one
            params, opt_state, value = hand_step(params, opt_state, placed_now)
        return float(value)

    # the same step written by hand as jaxpar runs it on several CPU processes: each process's gradients and loss
    # averaged as ONE flat buffer (one gloo all-reduce instead of one per gradient array)
    from jax.flatten_util import ravel_pytree

    flat_params = jax.device_put(nnx.split(MLP(nnx.Rngs(0)), nnx.Param)[1], replicated)
    flat_opt_state = jax.device_put(tx.init(flat_params), replicated)

    @jax.jit
    def flat_step(params, opt_state, batch):
        def own(params, batch):  # one process's rows; the replicated params marked per-process for the gradient
            params = jax.lax.pcast(params, "data", to="varying")
            value, grads = jax.value_and_grad(lambda p: loss_fn(nnx.merge(graphdef, p), batch)[0])(params)
            flat, unravel = ravel_pytree((value, grads))
            return unravel(jax.lax.pmean(flat, "data"))

        value, grads = jax.shard_map(own, mesh=trainer.mesh, in_specs=(P(), P("data")), out_specs=P(),
                                     axis_names={"data"})(params, batch)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, value

    def flat_round(n):
        nonlocal flat_params, flat_opt_state
        for _ in range(n):
            placed_now = {k: jax.make_array_from_process_local_data(rows, v, (GLOBAL_BATCH,) + v.shape[1:])
                          for k, v in batch.items()}
            flat_params, flat_opt_state, value = flat_step(flat_params, flat_opt_state, placed_now)
        return float(value)

    del placed
    jax_round(3), psum_round(3), torch_round(3), hand_round(3), flat_round(3)  # compile / warm up
    rates = {"jaxpar": [], "jaxpar_psum": [], "torch_ddp": [], "jax_jit": [], "jax_flat": []}
    for _ in range(rounds):
        for name, fn in (("jaxpar", jax_round), ("jaxpar_psum", psum_round), ("torch_ddp", torch_round),
                         ("jax_jit", hand_round),
                         ("jax_flat", flat_round)):
            dist.barrier()
            started = time.perf_counter()
            fn(steps)
            rates[name].append(steps * GLOBAL_BATCH / (time.perf_counter() - started))
    if rank == 0:
        with open(out, "w") as handle:
            json.dump(rates, handle)
    dist.destroy_process_group()


def ddp(args) -> dict:
    rates = _two_workers("_ddp_worker", args)
    result = {name: statistics.median(values) for name, values in rates.items()}
    result["ratio_jaxpar_to_ddp"] = result["jaxpar"] / result["torch_ddp"]
    result["ratio_jaxpar_to_jax_jit"] = result["jaxpar"] / result["jax_jit"]
    result["ratio_jaxpar_to_jax_flat"] = result["jaxpar"] / result["jax_flat"]
    result["ratio_jaxpar_psum_to_ddp"] = result["jaxpar_psum"] / result["torch_ddp"]
    result["rounds"] = rates
    print(f"2 processes x 1 CPU device, MLP {IN}-{HIDDEN}-{OUT} GELU, global batch {GLOBAL_BATCH}, AdamW: "
          f"jaxpar {result['jaxpar']:.0f} samples/s, jaxpar Sync('psum') {result['jaxpar_psum']:.0f}, torch DDP {result['torch_ddp']:.0f}, hand-written jax.jit "
          f"{result['jax_jit']:.0f}, hand-written one-buffer step {result['jax_flat']:.0f}; jaxpar / DDP "
          f"{result['ratio_jaxpar_to_ddp']:.3f}, Sync('psum') / DDP {result['ratio_jaxpar_psum_to_ddp']:.3f}, jaxpar / jit {result['ratio_jaxpar_to_jax_jit']:.3f}, jaxpar / "
          f"one-buffer {result['ratio_jaxpar_to_jax_flat']:.3f} (median of {args.rounds} alternating rounds of "
          f"{args.steps} steps)")
    return result


def allreduce_worker(rank: int, port: int, torch_port: int, rounds: int, steps: int, out: str) -> None:
    """The bare all-reduce between the 2 processes: XLA (jax.distributed, gloo) against torch.distributed (gloo),
    and XLA's all-reduce of the MLP's 5 gradient arrays as they are against the same bytes as one flat array."""
    os.environ["XLA_FLAGS"] = f"--xla_cpu_multi_thread_eigen=false {os.environ.get(EXTRA_FLAGS, '')}".strip()
    import jaxpar

    jaxpar.runtime.distributed.initialize(f"127.0.0.1:{port}", 2, rank, local_devices=1)
    import jax
    import jax.numpy as jnp
    import numpy as np
    import torch
    import torch.distributed as dist
    from jax.sharding import NamedSharding, PartitionSpec as P

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{torch_port}", rank=rank, world_size=2)
    mesh = jaxpar.make_mesh("2")
    rows, replicated = NamedSharding(mesh, P(("data", "fsdp"))), NamedSharding(mesh, P())

    def per_process(*shape):  # one row per process: summing over the rows is the all-reduce
        return jax.make_array_from_process_local_data(rows, np.ones((1, *shape), np.float32), (2, *shape))

    gradients = [(HIDDEN,), (HIDDEN, IN), (OUT,), (OUT, HIDDEN), ()]  # the MLP's gradients and its loss
    total = sum(int(np.prod(shape)) for shape in gradients)
    summed = jax.jit(lambda tree: jax.tree.map(lambda x: jnp.sum(x, 0), tree), out_shardings=replicated)
    cases = {"xla 4 B": [per_process()], "xla 1.1 MB": [per_process(total)],
             "xla 1.1 MB as 5 arrays": [per_process(*shape) for shape in gradients]}
    tensors = {"torch 4 B": torch.ones(1), "torch 1.1 MB": torch.ones(total)}
    calls = {**{name: (lambda a=a: jax.block_until_ready(summed(a))) for name, a in cases.items()},
             **{name: (lambda t=t: dist.all_reduce(t)) for name, t in tensors.items()}}
    for call in calls.values():
        call()
    times = {name: [] for name in calls}
    for _ in range(rounds):
        for name, call in calls.items():
            dist.barrier()
            started = time.perf_counter()
            for _ in range(steps):
                call()
            times[name].append((time.perf_counter() - started) / steps * 1e3)
    if rank == 0:
        with open(out, "w") as handle:
            json.dump(times, handle)
    dist.destroy_process_group()


def _two_workers(which: str, args) -> dict:
    """Starts the 2 worker processes of `which` ("_ddp_worker" or "_allreduce_worker"); process 0's JSON result."""
    import socket

    def port():
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            return probe.getsockname()[1]

    jax_port, torch_port = port(), port()
    with tempfile.TemporaryDirectory() as folder:
        out = os.path.join(folder, "result.json")
        env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
        env[EXTRA_FLAGS] = args.xla_flags
        workers = [subprocess.Popen([sys.executable, "-m", "benchmarks.distributed", which, str(rank),
                                     str(jax_port), str(torch_port), str(args.rounds), str(args.steps), out],
                                    cwd=ROOT, env=env)
                   for rank in range(2)]
        codes = [w.wait(timeout=1800) for w in workers]
        if any(codes):
            sys.exit(f"a worker failed: exit codes {codes}")
        return json.load(open(out))


def allreduce(args) -> dict:
    times = _two_workers("_allreduce_worker", args)
    result = {name: statistics.median(values) for name, values in times.items()}
    result["rounds"] = times
    print(f"milliseconds per all-reduce between 2 processes (median of {args.rounds} alternating rounds of "
          f"{args.steps}): " + ", ".join(f"{name} {result[name]:.2f}" for name in times))
    return result


def flatten(args) -> dict:
    """One process, one device: the MLP's gradients (and loss) of one step, left as they are, flattened with
    jnp.concatenate, or written into one buffer leaf by leaf as jaxpar does; ms per call."""
    os.environ["XLA_FLAGS"] = f"--xla_cpu_multi_thread_eigen=false {args.xla_flags}".strip()
    import jax
    import jax.numpy as jnp
    import numpy as np
    import optax
    from flax import nnx

    from jaxpar.parallel.collectives.buffers import one_buffer

    model = nnx.Sequential(nnx.Linear(IN, HIDDEN, rngs=nnx.Rngs(0)), lambda x: jax.nn.gelu(x, approximate=False),
                           nnx.Linear(HIDDEN, OUT, rngs=nnx.Rngs(1)))
    graphdef, params = nnx.split(model, nnx.Param)
    rng = np.random.default_rng(0)
    x, y = rng.standard_normal((GLOBAL_BATCH // 2, IN), dtype=np.float32), rng.integers(0, OUT, GLOBAL_BATCH // 2)

    def leaves(p):
        loss = lambda p: optax.softmax_cross_entropy_with_integer_labels(nnx.merge(graphdef, p)(x), y).mean()
        return jax.tree.leaves(jax.value_and_grad(loss)(p))

    forms = {"as they are": jax.jit(leaves),
             "concatenated": jax.jit(lambda p: jnp.concatenate([jnp.ravel(g) for g in leaves(p)])),
             "written in place": jax.jit(lambda p: one_buffer(leaves(p), jnp.float32))}
    times = {name: [] for name in forms}
    for fn in forms.values():
        jax.block_until_ready(fn(params))
    for _ in range(args.rounds):
        for name, fn in forms.items():
            started = time.perf_counter()
            for _ in range(args.steps):
                jax.block_until_ready(fn(params))
            times[name].append((time.perf_counter() - started) / args.steps * 1e3)
    result = {name: statistics.median(values) for name, values in times.items()}
    result["rounds"] = times
    print(f"ms per call, the MLP's gradients of one {GLOBAL_BATCH // 2}-row step (median of {args.rounds} alternating "
          f"rounds of {args.steps}): " + ", ".join(f"{name} {result[name]:.2f}" for name in times))
    return result


def processes(args) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    rates = {"1 process x 8 devices": [], "2 processes x 4 devices": []}
    with tempfile.TemporaryDirectory() as folder:
        for round_index in range(args.rounds):
            for name in rates:
                path = os.path.join(folder, f"{round_index}-{len(rates[name])}-{name[0]}.jsonl")
                command = ["run.py", "--mesh", "2x4", "--steps", str(args.steps), "--log-every", "1",
                           "--eval-batches", "0", "--metrics", path]
                if name.startswith("2"):
                    command = ["-m", "jaxpar.runtime.launch", "--nproc", "2", "--", *command]
                subprocess.run([sys.executable, *command], cwd=ROOT, env=env, check=True, capture_output=True,
                               timeout=1800)
                records = [json.loads(line) for line in open(path)]
                per_step = [r["samples_per_sec"] for r in records if r.get("step", 0) > 10 and "loss" in r]
                rates[name].append(statistics.mean(per_step))
    result = {name: statistics.median(values) for name, values in rates.items()}
    one, two = result.values()
    result["ratio_2_processes_to_1"] = two / one
    result["rounds"] = rates
    print(f"default transformer, --mesh 2x4, {args.steps} steps: 1 process x 8 devices {one:.1f} samples/s, "
          f"2 processes x 4 devices {two:.1f} samples/s, ratio {two / one:.3f}")
    return result


def main():
    if len(sys.argv) > 1 and sys.argv[1] in ("_ddp_worker", "_allreduce_worker"):
        rank, port, torch_port, rounds, steps = map(int, sys.argv[2:7])
        worker = ddp_worker if sys.argv[1] == "_ddp_worker" else allreduce_worker
        worker(rank, port, torch_port, rounds, steps, sys.argv[7])
        return
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("which", choices=("ddp", "allreduce", "flatten", "processes"))
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--xla-flags", default="", help="more XLA flags for every JAX step of the ddp / allreduce "
                                                         "workers, e.g. --xla_cpu_multi_thread_eigen=true")
    args = parser.parse_args()
    result = {"ddp": ddp, "allreduce": allreduce, "flatten": flatten, "processes": processes}[args.which](args)
    print(json.dumps({"benchmark": f"distributed {args.which}", **result}))


if __name__ == "__main__":
    main()
