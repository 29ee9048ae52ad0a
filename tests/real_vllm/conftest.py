"""Fixtures of the real-vLLM tests: the session's `Stack` (two vLLM engines, their
sidecars and raw-event readers; `tests/helpers/vllm_stack.py`) and routers per test.
No skipping: when the vLLM environment cannot be built or an engine does not start,
every test here errors with the reason."""

from __future__ import annotations

import sys
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "helpers"))

from vllm_engines import BLOCK, RawEvents, VllmEngine, vllm_env
from vllm_stack import SMALL_BLOCKS, Stack

from ramjet.app.server import RouterServer


@pytest.fixture(scope="session")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    from ramjet.reports.keys import write_keypair

    env = vllm_env()  # raises with the reason: these tests never skip
    work = tmp_path_factory.mktemp("vllm")
    engines = {
        "v0": VllmEngine("v0", env, core=0, workdir=work / "v0"),
        "v1": VllmEngine(
            "v1",
            env,
            core=1,
            num_blocks=SMALL_BLOCKS,
            max_model_len=(SMALL_BLOCKS - 1) * BLOCK,
            workdir=work / "v1",
        ),
    }
    st = Stack(env, work, engines)
    for e in engines.values():
        e.workdir.mkdir()
        write_keypair(st.keys, f"{e.engine_id}-sc")
    try:
        for e in engines.values():
            e.start()
        for e in engines.values():
            e.wait_ready()
        for eid, e in engines.items():
            st.raw[eid] = RawEvents(e.events_url)
            st.start_sidecar(eid)
        time.sleep(0.5)  # ZMQ slow joiner: subscriptions reach the engines
        # each sidecar probes its engine's profile at start, with prompts that fill
        # blocks: tests begin once both probes are done (their traffic and cached blocks
        # would otherwise mix into the first test's)
        deadline = time.monotonic() + 180
        for eid, sc in st.sidecars.items():
            while sc.health()["profile"] is None:
                if time.monotonic() > deadline:
                    raise AssertionError(f"sidecar {eid} published no profile: {sc.log}")
                time.sleep(0.2)
        yield st
    finally:
        for sc in st.sidecars.values():
            sc.stop()
        for raw in st.raw.values():
            raw.close()
        for e in engines.values():
            e.stop()


@pytest.fixture
async def routers() -> AsyncIterator[list[RouterServer]]:
    """Routers a test starts (append them): stopped at the end of the test."""
    started: list[RouterServer] = []
    yield started
    for s in started:
        await s.stop(drain_s=1.0)
