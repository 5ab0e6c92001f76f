"""Every test runs on 8 CPU devices; this must happen before JAX initialises its backend."""
import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")
flags = os.environ.get("XLA_FLAGS", "")
if "xla_force_host_platform_device_count" not in flags:
    os.environ["XLA_FLAGS"] = (flags + " --xla_force_host_platform_device_count=8").strip()

import jax  # noqa: E402

assert len(jax.devices()) == 8, f"tests need 8 CPU devices, got {jax.devices()}"
