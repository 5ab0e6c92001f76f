"""The Ray runtime: replica groups as processes and a parameter server, for wall-clock asynchrony.

`run(model, loss_fn, optimizer, mesh, strategy, batches, steps)` trains with each index of the mesh's data axis as
a Ray actor process (`ReplicaWorker`, its own Trainer on the other axes) and a `ParameterServer` actor applying
their gradients by the strategy's rule: the emulation's semantics (`jaxpar.strategies.stale`), in real time.

    server.py     the parameter server: versions, the staleness rule, (worker, seq) bookkeeping, records
    shards.py     the server's parameters and optimizer split over shard actors by bytes (server_shards > 1)
    worker.py     a worker's loop: join, compute, straggle, push; its JSONL records
    compute.py    a worker's JAX side: gradients and local steps on its own mesh, numpy in and out
    schedule.py   the real schedule and its replay through the emulation
    checkpoint.py the server's state saved with orbax, and restored
    outer.py      delayed Nesterov, the outer optimizer of asynchronous local SGD / DiLoCo
    spec.py       the run's parts and the strategy's rule on the runtime, checked
    connect.py    Ray started quietly; each actor's environment
    driver.py     `run`: start, watch (faults, restarts), progress, result
"""

from jaxpar.runtime.ray.driver import RayRun, run
from jaxpar.runtime.ray.outer import delayed_nesterov
from jaxpar.runtime.ray.schedule import Delivery, replay_batches, replay_strategy

__all__ = ["Delivery", "RayRun", "delayed_nesterov", "replay_batches", "replay_strategy", "run"]
