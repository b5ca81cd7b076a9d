"""Shared test settings. Tests run on CPU; parity references come from HF transformers on PyTorch CPU.

JAXINFER_TEST_DEVICE=1 lets jax pick its accelerator (its default backend: a GPU or TPU when jax's CUDA or TPU wheels
are installed; JAX_PLATFORMS still forces one) so that tests/device/ runs there; see README.md, "Tests on a GPU or
TPU". Without it every test process is pinned to the CPU.
"""

import os

DEVICE_TESTS = os.environ.get("JAXINFER_TEST_DEVICE") == "1"

os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
# The executable cache (serialized steps, jaxinfer.engine.exec_cache) is on, as for users: engines warm up as theirs
# do (each bucket compiled ahead of time, not run), and an engine built with a step another test compiled in this run
# loads it instead of tracing and lowering it again (a cold suite: 717 -> 674 s of pytest on a 2-core znver5).

if not DEVICE_TESTS:
    # Pinned: on a GPU/TPU host the CPU suite must not grab the accelerator, and CI has none.
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
else:
    # The kernel tests hold f32 results to the f64 oracle at 1e-5 (tests/kernels/paged_attention_cases.py). On a GPU
    # jax's default f32 dot is TF32 (~1e-3) and on a TPU bf16 passes, in the references and in interpret mode alike:
    # on an H200, 44 f32 cases of tests/kernels failed that way and no bf16 one. Full-precision f32 dots keep
    # those comparisons about the kernels' math; bf16 runs (the engine's default on a device) are unaffected.
    os.environ.setdefault("JAX_DEFAULT_MATMUL_PRECISION", "highest")

# One persistent compilation cache for the test processes and the servers they start: the folder an engine on the
# default cache uses (runner.enable_compilation_cache), so a program compiled once on a machine is loaded, not
# recompiled, by later tests and runs. A test process that builds no engine would otherwise write to the top level
# of the default folder, whose jax entries every engine's start deletes as left over from before version folders
# (during one run here the folder held 88 of them, and 30 two minutes later). Counting compiles still works: jax
# reports a cache load as a backend compile too (jaxinfer.engine.runner.compile_count). Set after the JAX_* settings
# above, which jax reads when it is imported.
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
    import jax

    from jaxinfer.engine.exec_cache import default_folder, jax_cache_dir

    os.environ["JAX_COMPILATION_CACHE_DIR"] = str(jax_cache_dir(default_folder()))
    jax.config.update("jax_compilation_cache_dir", os.environ["JAX_COMPILATION_CACHE_DIR"])


def pytest_collection_modifyitems(config, items):
    from tests import side_child

    side_child.select(config, items)


def pytest_collection_finish(session):
    # The children (tests/children.py) start now, when their launcher tests are selected, and run beside this
    # session's tests.
    from tests import eight_devices, side_child

    eight_devices.start_with_session(session.items)
    side_child.start_with_session()


def pytest_sessionfinish(session, exitstatus):
    from tests import children

    children.stop_all()
