"""How long one request can hold up the others' admission: the router is one thread, so a
message at the default limits (the longest text prompt, the largest frame) must be handled within
the bound docs/protocol.md states. The real router and bench.frontend's stand-in leader, as
processes (CPU)."""

from __future__ import annotations

import random
import statistics
import time
from pathlib import Path

import pytest

from pdserve.bench.frontend import stand_in_cluster
from pdserve.cluster.client import Client, ClusterError
from pdserve.cluster.config import MIN_PROMPT_CHARS

# docs/protocol.md ("Limits"): at the default --max-prompt-chars and --max-message-mib, one
# message holds the router for at most this long on the 2-core CPU machine.
ADMISSION_BOUND_S = 0.5


@pytest.mark.slow
def test_a_normal_request_completes_within_the_bound_while_a_maximal_prompt_is_admitted(
    demo_model_dir: Path,
) -> None:
    """The slowest prompt to tokenize that the default limit admits (4-byte characters, each
    several tokens, in a chat turn) goes first; a short request from another client right after
    it completes within the bound plus its own time alone."""
    limit = MIN_PROMPT_CHARS  # the default limit at the stand-in's maximum model length
    rng = random.Random(0)
    worst = "".join(chr(rng.randint(0x1F300, 0x1F5FF)) for _ in range(limit))
    with (
        stand_in_cluster(output_len=4, step_ms=0.0, tokenizer=str(demo_model_dir)) as setup,
        Client(setup.endpoint, timeout=60) as normal,
        Client(setup.endpoint, timeout=60) as hostile,
    ):
        normal.generate(token_ids=[1, 2, 3], max_tokens=4)  # the router is up
        alone = []
        for _ in range(5):
            start = time.perf_counter()
            normal.generate(token_ids=[1, 2, 3], max_tokens=4)
            alone.append(time.perf_counter() - start)

        admitted = hostile.submit(worst, chat=True, max_tokens=4)
        time.sleep(0.02)  # the router is reading it, then tokenizing it
        start = time.perf_counter()
        final = normal.generate(token_ids=[1, 2, 3], max_tokens=4)
        waited = time.perf_counter() - start

        with pytest.raises(ClusterError) as refused:  # tokenized, then refused
            hostile.result(admitted)
    assert len(final.token_ids) == 4
    assert waited <= ADMISSION_BOUND_S + statistics.median(alone), (waited, alone)
    assert refused.value.code == "invalid_request"
