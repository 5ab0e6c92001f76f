"""Every test runs on 8 CPU devices; this must happen before JAX initialises its backend."""
import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")
flags = os.environ.get("XLA_FLAGS", "")
if "xla_force_host_platform_device_count" not in flags:
    flags += " --xla_force_host_platform_device_count=8"
# Tests are dominated by compiling many small programs: XLA:CPU's backend at optimisation level 0 compiles them
# about 3x faster. The programs and their HLO are the same; the machine code is less tuned, so float results may
# differ from the default build's in the last bits (e.g. without fused multiply-adds), which every tolerance allows.
# Processes the tests start get it too (tests.helpers.child_env), so in-process and subprocess runs stay identical.
if "xla_backend_optimization_level" not in flags:
    flags += " --xla_backend_optimization_level=0"
# ... and its older fusion emitters compile them in about 20% less CPU time than the MLIR-based ones (measured on
# the seq and pipeline steps of the transformer: 25.1 -> 19.9 s of backend compilation for 9 programs)
if "xla_cpu_use_fusion_emitters" not in flags:
    flags += " --xla_cpu_use_fusion_emitters=false"
os.environ["XLA_FLAGS"] = flags.strip()

import gc  # noqa: E402

import jax  # noqa: E402

assert len(jax.devices()) == 8, f"tests need 8 CPU devices, got {jax.devices()}"

import atexit  # noqa: E402
import shutil  # noqa: E402
import tempfile  # noqa: E402

# Many tests build identical trainers (the same model, mesh and strategy): JAX's persistent compilation cache,
# keyed by the compiled program, lets later ones skip XLA compilation. A fresh folder per session: nothing stale.
# pytest-xdist's workers inherit the controller's environment, so they share one folder (the controller's, which
# it removes at exit); a lone pytest process makes and removes its own.
_cache = os.environ.get("JAXPAR_TEST_CACHE")
if _cache is None or not os.path.isdir(_cache):
    _cache = os.environ["JAXPAR_TEST_CACHE"] = tempfile.mkdtemp(prefix="jaxpar-test-cache-")
    atexit.register(shutil.rmtree, _cache, ignore_errors=True)
jax.config.update("jax_compilation_cache_dir", _cache)
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
# ... shared with the processes the tests start (run.py killed and resumed, device-failure scripts): same programs
os.environ.update(JAX_COMPILATION_CACHE_DIR=_cache, JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0",
                  JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES="0")


# The longest files first (test seconds in a whole run): pytest-xdist hands out whole files (--dist loadfile) in
# collection order, so a long file collected last would keep one worker busy after the others are done. The Ray and
# multi-process files mostly wait on their processes, which run beside the other workers' tests.
LONGEST_FIRST = [
    "tests/runtime/test_ray_runtime.py", "tests/pipeline/test_pipeline_trainer.py",
    "tests/strategies/test_strategies.py", "tests/parallel/test_seq_equivalence.py", "tests/models/test_transformer.py",
    "tests/runtime/test_distributed.py", "tests/cli/test_resume_cli.py", "tests/parallel/test_compression_meetings.py",
    "tests/cli/test_cli_ray.py", "tests/cost/test_memory_fit.py", "tests/train/test_remat.py",
    "tests/parallel/test_seq_composition.py",
    "tests/advisor/test_advisor.py", "tests/cli/test_cli.py"]


# Tracing and lowering make many short-lived Python objects: at CPython's default thresholds (700, 10, 10) the cyclic
# garbage collector took 4.4% of a worker's CPU (perf, tests/strategies/test_strategies.py). Rarer collections, and
# what is alive once the tests are collected (JAX, Flax, the test modules) kept out of them.
gc.set_threshold(50_000, 20, 20)


def pytest_collection_finish(session):
    gc.collect()
    gc.freeze()


def pytest_collection_modifyitems(config, items):
    rank = {path: i for i, path in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.nodeid.split("::")[0], len(rank)))  # stable: the rest keep their order
