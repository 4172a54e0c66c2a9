"""The decode side of prefix caching in real CPU clusters: a chat's later turns move only the KV
blocks that the decode group does not hold from the earlier turns, on every CPU backend and
across TP degrees, and the greedy tokens are the single engine's without any cache."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from pdserve.cluster.client import Client, Final
from pdserve.engine.config import ModelConfig
from pdserve.engine.sampling import SamplingParams
from pdserve.tests.cluster.helpers import abort_mid_stream, oracle, run_concurrently, wait_until_idle
from pdserve.tests.engine.helpers import common_prefix_len

BLOCK = 16  # the clusters' default block size
MAX_TOKENS = 8
FIRST_LENS = [2 * BLOCK, 2 * BLOCK + 5, BLOCK + 4]  # one chat each: block-aligned and not
NEW_LENS = [BLOCK, 5, 11]  # each later turn adds these to the last prompt and its answer
TURNS = 3


@pytest.mark.slow
@pytest.mark.parametrize(
    ("prefill_tp", "decode_tp", "decode_groups", "transfer", "cache"),
    [
        (1, 1, 1, "gloo", True),
        (1, 1, 1, "gloo-async", True),
        (1, 1, 1, "shm", True),
        (2, 1, 1, "gloo-async", True),
        (1, 2, 1, "shm", True),
        (1, 1, 2, "gloo-async", True),
        (1, 1, 1, "gloo", False),
    ],
    ids=[
        "1p1d-gloo",
        "1p1d-gloo-async",
        "1p1d-shm",
        "2p1d-gloo-async",
        "1p2d-shm",
        "two-decode-groups",
        "1p1d-gloo-no-cache",
    ],
)
def test_later_turns_move_only_the_kv_the_decode_group_lacks(
    cluster_factory,
    tiny_model_dirs: dict[str, Path],
    prefill_tp: int,
    decode_tp: int,
    decode_groups: int,
    transfer: str,
    cache: bool,
) -> None:
    """Three chats of three turns, each turn's prompt the last one, its answer and a few new
    tokens; the chats' turns run together. Each final's tokens are the single engine's; its
    ``decode_cached_tokens`` is the longest block-aligned prefix of its prompt that the decode
    group computed for the chat's earlier turn (prompt and answer but the last token), the
    prompt's last token left out; and ``transfer_bytes`` is the KV of the other blocks alone.
    With two decode groups the chats' first turns spread over both by load, and cache-aware
    dispatch (the default) sends each later turn to the group holding its chat. An abort of a
    later turn mid-stream leaves every block free or cached."""
    model_dir = tiny_model_dirs["tiny-llama-odd"]  # 9 query / 3 KV heads: TP 2 splits them unevenly
    args = ["--model", str(model_dir), "--prefill-tp", str(prefill_tp), "--decode-tp", str(decode_tp)]
    args += ["--decode-groups", str(decode_groups), "--transfer", transfer, "--num-blocks", "200"]
    args += [] if cache else ["--no-prefix-cache"]
    cluster = cluster_factory(*args)
    model = ModelConfig.from_pretrained(model_dir)
    # A block's KV, every head: what a decode leader of TP 1 receives, or a pulling one copies for
    # its whole group (a pushed receive of TP 2 would count the leader's heads alone).
    assert decode_tp == 1 or transfer == "shm"
    block_bytes = model.num_layers * 2 * BLOCK * model.num_kv_heads * model.head_dim * 4  # fp32
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    rng = random.Random(7)
    prompts = [[rng.randrange(500) for _ in range(n)] for n in FIRST_LENS]
    computed: list[list[int]] = [[] for _ in prompts]  # what the decode group computed per chat
    decode_hits = 0
    with Client(cluster.endpoint, timeout=120) as client:
        for turn in range(TURNS):
            expected = oracle(model_dir, prompts, [params] * len(prompts))
            finals: list[Final] = run_concurrently(client, prompts, [params] * len(prompts))
            assert [f.token_ids for f in finals] == expected, f"turn {turn}"
            for chat, (prompt, final) in enumerate(zip(prompts, finals)):
                held = min(common_prefix_len(prompt, computed[chat]), len(prompt) - 1) // BLOCK
                moved = -(-len(prompt) // BLOCK) - (held if cache else 0)
                if cache:
                    assert final.timings["decode_cached_tokens"] == held * BLOCK, (turn, chat)
                    assert turn == 0 or held > 0
                    decode_hits += held * BLOCK
                else:
                    assert "decode_cached_tokens" not in final.timings
                assert final.timings["transfer_bytes"] == moved * block_bytes, (turn, chat)
                computed[chat] = prompt + final.token_ids[:-1]
                prompts[chat] = prompt + final.token_ids + [rng.randrange(500) for _ in range(NEW_LENS[chat])]

        # A later turn aborted mid-stream, its cached prefix locked meanwhile: every block comes back.
        abort_mid_stream(client, prompts[0])
        decodes = [f"decode{d}" for d in range(decode_groups)]
        groups = wait_until_idle(client, also=lambda g: sum(g[d]["prefix_hit_tokens"] for d in decodes) >= decode_hits)
        if decode_groups > 1:  # the chats did spread
            assert all(groups[d]["prefix_hit_tokens"] > 0 for d in decodes)
        if not cache:
            assert groups["decode0"]["prefix_queried_tokens"] == 0
    assert cluster.stop() == 0, cluster.output()[-4000:]
