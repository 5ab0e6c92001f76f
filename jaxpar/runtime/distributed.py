"""Several processes, one mesh: JAX's own multi-controller runtime (`jax.distributed`), never a home-made transport.

Every process runs the same program on its own devices; together they form one global mesh. On CPU the
collectives go over gloo (TCP), on GPU over NCCL, on TPU over ICI/DCN: jaxpar only chooses gloo for the CPU
backend and starts the runtime.

    import jaxpar
    jaxpar.runtime.distributed.initialize("10.0.0.1:1234", num_processes=2, process_id=0)   # before anything else uses JAX
    mesh = jaxpar.make_mesh("2x4")                                                   # spans both processes

With no arguments, `initialize` takes its settings from the environment: first the variables `jaxpar.launch`
sets (`JAXPAR_COORDINATOR`, `JAXPAR_NUM_PROCESSES`, `JAXPAR_PROCESS_ID`, `JAXPAR_LOCAL_DEVICES`), then JAX's own
cluster detection (SLURM, Open MPI, Kubernetes, ...). Outside any of these it does nothing: one process.

Gradients across processes on CPU: XLA:CPU runs a combined all-reduce (one HLO all-reduce of several arrays) as one
gloo all-reduce per array, each a TCP round trip (the MLP's 5 gradient arrays: 14.33 ms, the same bytes as one
array: 2.46 ms). So on several CPU processes, on a pure data-parallel mesh, the explicit averages (`Sync(allreduce=
"psum")`, local SGD / DiLoCo meetings, SSP / ASP updates) send ONE flat buffer per dtype (`one_buffer_gradients`;
docs/processes.md, "Measured"). The default `Sync()` keeps the compiler's step (exactly the single-device
computation): its all-reduce is placed by the partitioner, one array per gradient.

Failure: each process sends the coordinator a heartbeat; a process that stops for `heartbeat_seconds` is declared
lost and every other process is told so and stops (see `HEARTBEAT_SECONDS`). A collective whose peer died fails at
once over gloo (its connection closes), so no process waits in a collective for a dead peer.
"""

from __future__ import annotations

import logging
import os
import re

import jax

from jaxpar.checks import int_problem
from jaxpar.errors import ConfigError, OptionError

log = logging.getLogger("jaxpar")

ENV_COORDINATOR = "JAXPAR_COORDINATOR"
ENV_NUM_PROCESSES = "JAXPAR_NUM_PROCESSES"
ENV_PROCESS_ID = "JAXPAR_PROCESS_ID"
ENV_LOCAL_DEVICES = "JAXPAR_LOCAL_DEVICES"

# A process not heard from for this long is lost: the others stop (well inside a minute). JAX's default is 100 s.
HEARTBEAT_SECONDS = 10
# How long a finishing process waits at shutdown for the others to finish too (JAX's default is 300 s).
SHUTDOWN_SECONDS = 30
# How long processes wait for each other to connect at start-up (all must be started within this).
CONNECT_SECONDS = 120

_started: dict | None = None


PORTS = (1, 65536)  # the TCP ports a coordinator may listen on: [low, high)


def port_problem(port) -> str | None:
    """The one check of a TCP port (None: fine)."""
    return int_problem(port, *PORTS, why="a TCP port")


def _check_address(address, name: str) -> str:
    if not isinstance(address, str) or not re.fullmatch(r"[^\s:]+:[0-9]{1,5}", address) \
            or port_problem(int(address.rsplit(":", 1)[1])):
        raise OptionError(name, address, "must be HOST:PORT of process 0, e.g. 10.0.0.1:1234 (the same on every "
                                         "process)")
    return address


def _check_int(value, name: str, low: int, what: str) -> int:
    problem = int_problem(value, low, why=what)
    if problem:
        raise OptionError(name, value, problem)
    return value


def settings_from_environment(environ=None) -> dict:
    """The settings `jaxpar.launch` put in the environment ({} when there are none)."""
    environ = os.environ if environ is None else environ
    if ENV_COORDINATOR not in environ:
        return {}
    out = {"coordinator": environ[ENV_COORDINATOR]}
    for key, name in ((ENV_NUM_PROCESSES, "num_processes"), (ENV_PROCESS_ID, "process_id"),
                      (ENV_LOCAL_DEVICES, "local_devices")):
        if environ.get(key):
            try:
                out[name] = int(environ[key])
            except ValueError:
                raise ConfigError(f"environment variable {key}={environ[key]!r}: must be an integer (jaxpar.launch "
                                  f"sets it)") from None
    return out


def cluster_detected() -> str | None:
    """The name of the cluster environment JAX's own detection would use (several tasks of one job), or None."""
    env = os.environ
    if int(env.get("SLURM_NTASKS", "1") or 1) > 1 and "SLURM_STEP_ID" in env:
        return "SLURM"
    if int(env.get("OMPI_COMM_WORLD_SIZE", "1") or 1) > 1:
        return "Open MPI"
    return None


def initialize(coordinator: str | None = None, num_processes: int | None = None, process_id: int | None = None, *,
               local_devices: int | None = None, heartbeat_seconds: int = HEARTBEAT_SECONDS,
               shutdown_seconds: int = SHUTDOWN_SECONDS, connect_seconds: int = CONNECT_SECONDS) -> bool:
    """Joins this process to the others; True if it now runs as one of several processes.

    Call it first, before anything else uses JAX. `coordinator` is "HOST:PORT" of process 0 (the same string on
    every process), `num_processes` the total and `process_id` this one's rank (0 .. num_processes - 1).
    All None: the environment decides (see the module docstring); none set there: one process, nothing done.
    `local_devices`: on CPU, how many CPU devices this process creates (mesh size / processes).
    """
    global _started
    if coordinator is None and num_processes is None and process_id is None:
        settings = settings_from_environment()
        if not settings:
            if cluster_detected() is None:
                return False
            settings = {}
        coordinator, num_processes = settings.get("coordinator"), settings.get("num_processes")
        process_id = settings.get("process_id")
        local_devices = local_devices if local_devices is not None else settings.get("local_devices")
    else:
        if coordinator is None or num_processes is None or process_id is None:
            missing = [n for n, v in (("coordinator", coordinator), ("num_processes", num_processes),
                                      ("process_id", process_id)) if v is None]
            raise OptionError(missing[0], None, "give {coordinator}, {num_processes} and {process_id} together (or "
                                                "none of them, to read them from the environment)")
    if coordinator is not None:
        _check_address(coordinator, "coordinator")
    if num_processes is not None:
        _check_int(num_processes, "num_processes", 1, "processes in the job")
    if process_id is not None:
        _check_int(process_id, "process_id", 0, "this process's rank")
        if num_processes is not None and process_id >= num_processes:
            raise OptionError("process_id", process_id, f"must be below {{num_processes}} ({num_processes})")
    if local_devices is not None:
        _check_int(local_devices, "local_devices", 1, "CPU devices of this process")
    if _started is not None:
        return True
    if num_processes == 1:
        if local_devices:
            _set_cpu_devices(local_devices)
        return False
    from jaxpar.runtime.cpu_devices import backend_started

    if backend_started():
        raise OptionError("initialize", "late", "jaxpar.runtime.distributed.initialize must run before anything else uses "
                                                "JAX (JAX has already started its devices)")
    if jax.config.jax_cpu_collectives_implementation in (None, "", "none"):
        jax.config.update("jax_cpu_collectives_implementation", "gloo")  # CPU only; GPUs use NCCL regardless
    if local_devices:
        _set_cpu_devices(local_devices)
    jax.distributed.initialize(coordinator_address=coordinator, num_processes=num_processes, process_id=process_id,
                               initialization_timeout=connect_seconds, heartbeat_timeout_seconds=heartbeat_seconds,
                               shutdown_timeout_seconds=shutdown_seconds)
    _started = {"coordinator": coordinator, "num_processes": jax.process_count(), "process_id": jax.process_index()}
    return True


def _several_cpu_processes() -> bool:
    """The backend is XLA:CPU (collectives over gloo) and this run spans several processes."""
    return jax.default_backend() == "cpu" and jax.process_count() > 1


def one_buffer_gradients(mesh) -> bool:
    """The one decision whether an explicit average over the replica axis (a native communicator's gradient or
    parameter mean, not the compiler's step) is sent as one flat buffer per dtype: on CPU across several processes (XLA:CPU sends each array of a combined all-reduce as its own gloo
    all-reduce: 5 arrays cost 5 round trips), on a pure data-parallel mesh (every axis but the replica axis of size
    1: flattening an fsdp- or model-sharded gradient would first all-gather it)."""
    from jaxpar.parallel import mesh as mesh_lib

    return mesh_lib.size(mesh, mesh_lib.WITHIN_REPLICA_AXES) == 1 and _several_cpu_processes()


def _set_cpu_devices(count: int) -> None:
    from jaxpar.runtime.cpu_devices import user_set_cpu_device_count

    if not user_set_cpu_device_count():
        jax.config.update("jax_num_cpu_devices", count)


def process_index() -> int:
    """This process's rank (0 in a single process), without starting JAX's devices if nothing has yet."""
    from jaxpar.runtime.cpu_devices import backend_started

    if _started is not None:
        return _started["process_id"]
    return jax.process_index() if backend_started() else 0


def is_main() -> bool:
    """True in process 0, the one that prints, logs and writes the metrics files."""
    return process_index() == 0


def to_host(tree):
    """Numpy copies of the whole of every array in `tree`, also of shards other processes hold (then every process
    must call this: it is a collective)."""
    leaves = jax.tree.leaves(tree)
    if any(isinstance(x, jax.Array) and not x.is_fully_addressable and not x.is_fully_replicated for x in leaves):
        from jax.experimental import multihost_utils

        tree = multihost_utils.process_allgather(tree, tiled=True)
    return jax.device_get(tree)


def lost_processes(wait_seconds: float = 5.0) -> list[int]:
    """The processes the coordinator no longer hears from (polled for up to `wait_seconds`, since a process that
    just died is noticed within a moment); [0] when the coordinator itself is gone; [] in a single process."""
    import time

    from jax._src import distributed as jax_distributed  # the runtime's client: no public API lists live processes

    client, count = jax_distributed.global_state.client, jax.process_count()
    if client is None or count == 1:
        return []
    deadline = time.monotonic() + wait_seconds
    while True:
        try:
            live = client.get_live_nodes(list(range(count)))
        except Exception:  # the coordinator (process 0) does not answer
            return [0]
        gone = sorted(set(range(count)) - set(live))
        if gone or time.monotonic() > deadline:
            return gone
        time.sleep(0.2)
