"""The engine benchmarks and their helpers on CPU: smoke runs of ``bench.decode`` and
``bench.tp_decode`` with tiny presets, and the pieces the GPU tests build on."""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from pdserve.bench import batch_divergence, decode, tp_decode
from pdserve.bench.common import (
    Divergence,
    block_tables,
    compare_greedy,
    decode_plan,
    divergences,
    fill_kv_random,
    teacher_forced_logits,
)
from pdserve.bench.harness import run_tp_group
from pdserve.engine.config import CacheConfig, EngineConfig, ModelConfig
from pdserve.engine.model_runner import ModelRunner

# The documented smoke run, with a small batched prefill and one warm-up call to keep CI fast.
SMOKE = [
    "--preset",
    "tiny-llama",
    "--device",
    "cpu",
    "--batch-sizes",
    "1,2",
    "--contexts",
    "16,32",
    "--prefill-lens",
    "32",
    "--iters",
    "2",
    "--prefill-batches",
    "4x16",
    "--warmup",
    "1",
]


@pytest.fixture
def preset_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Presets are written into a fresh cache, not the user's."""
    monkeypatch.setenv("PDSERVE_CACHE", str(tmp_path / "cache"))
    return tmp_path


def positive(entry: dict) -> bool:
    return all(entry[key] > 0 for key in ("median_ms", "min_ms", "max_ms"))


@pytest.mark.slow
def test_decode_bench_cpu_smoke(preset_cache: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out, plot = preset_cache / "decode.json", preset_cache / "decode.png"
    decode.main([*SMOKE, "--hf-generate", "--hf-generate-tokens", "4", "--out", str(out), "--plot", str(plot)])
    result = json.loads(out.read_text())
    assert plot.read_bytes().startswith(b"\x89PNG")

    meta = result["metadata"]
    for key in (
        "date",
        "device",
        "torch",
        "triton",
        "transformers",
        "command",
        "preset",
        "dtype",
        "hf_mode",
        "weight_bytes",
        "kv_bytes_per_token",
    ):
        assert key in meta, key
    assert meta["preset"] == "tiny-llama" and meta["dtype"] == "float32" and meta["hf_mode"] == "eager"
    assert "--contexts 16,32" in meta["command"]

    cases = {c["case"]: c for c in result["cases"]}
    decodes = [f"decode B={b} C={c}" for c in (16, 32) for b in (1, 2)]
    assert list(cases) == [*decodes, "prefill 1x32", "prefill 4x16"]
    for name, case in cases.items():
        assert "ours_graph" not in case  # no CUDA graphs on CPU
        assert positive(case["ours_eager"]) and positive(case["hf"]), name
        assert case["speedup_vs_hf"] > 0 and case["tokens_per_s"] > 0
    for name in decodes:
        case = cases[name]
        assert case["floor_ms"] > 0 and case["floor_fraction"] > 0
        assert case["kv_bytes_read"] == case["batch"] * case["context"] * meta["kv_bytes_per_token"]
        # generate() is timed for batch-1 cases only
        assert ("hf_generate" in case) == (case["batch"] == 1), name
        if case["batch"] == 1:
            assert case["hf_generate"]["median_ms"] > 0 and case["speedup_vs_hf_generate"] > 0

    table = capsys.readouterr().out
    assert "% of floor" in table and "decode B=2 C=32" in table

    # The saved result re-prints the same table and re-plots without measuring anything.
    replot = preset_cache / "again.png"
    assert decode.main(["--from-json", str(out), "--plot", str(replot)]) == result
    reprinted = capsys.readouterr().out.splitlines()[: len(cases) + 2]  # header, rule, a row per case
    assert reprinted[0].startswith("case") and all(line in table.splitlines() for line in reprinted)
    assert replot.read_bytes().startswith(b"\x89PNG")


@pytest.mark.slow
def test_tp_decode_bench_cpu_smoke(preset_cache: Path) -> None:
    out = preset_cache / "tp.json"
    tp_decode.main(
        [
            "--preset",
            "tiny-llama",
            "--device",
            "cpu",
            "--tp",
            "1,2",
            "--batch-sizes",
            "1,2",
            "--contexts",
            "16",
            "--iters",
            "2",
            "--warmup",
            "1",
            "--out",
            str(out),
        ]
    )
    result = json.loads(out.read_text())
    assert set(result["groups"]) == {"1", "2"}
    for group in result["groups"].values():
        assert not group["graphs"]
        assert [(c["batch"], c["context"]) for c in group["cases"]] == [(1, 16), (2, 16)]
        assert all(positive(c) and c["floor_ms"] > 0 for c in group["cases"])
    # Each of two ranks holds half the KV heads.
    assert result["groups"]["2"]["rank0_kv_bytes_per_token"] * 2 == result["groups"]["1"]["rank0_kv_bytes_per_token"]


def test_prefill_cases_may_be_left_out() -> None:
    assert decode.parse_prefill_lens("") == [] and decode.parse_prefill_batches("") == []
    assert decode.parse_prefill_lens("512,2048") == [512, 2048]
    with pytest.raises(ValueError):
        decode.parse_prefill_lens("0")


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_fill_kv_random_fills_all_but_the_dummy_block_by_seed(device: str) -> None:
    """On CUDA the fill is a captured graph's replay (bench.common says why): it must still give
    standard-normal K/V in every real block, leave the dummy block zero, and follow the seed."""
    layers, blocks = 3, 6
    kv_cache = torch.zeros(layers, 2, blocks + 1, 16, 2, 32, dtype=torch.bfloat16, device=device)
    runner = SimpleNamespace(kv_cache=kv_cache, num_blocks=blocks, device=torch.device(device))
    fill_kv_random(runner, seed=3)
    first = kv_cache.clone()
    real = first[:, :, :blocks].float()
    assert first[:, :, blocks].count_nonzero() == 0
    assert abs(real.mean().item()) < 0.05 and abs(real.std().item() - 1) < 0.05
    assert (real[:, :, :, 0, 0, 0] != 0).all()  # every block of every layer written
    kv_cache.zero_()
    fill_kv_random(runner, seed=3)
    assert torch.equal(kv_cache, first)
    fill_kv_random(runner, seed=4)
    assert not torch.equal(kv_cache, first) and kv_cache[:, :, blocks].count_nonzero() == 0


def test_decode_plan_addresses_the_last_position() -> None:
    gen = torch.Generator().manual_seed(0)
    tables = block_tables([33, 16, 1], block_size=16, num_blocks=10, generator=gen)
    assert [len(t) for t in tables] == [3, 1, 1]
    assert len({b for t in tables for b in t}) == 5 and all(0 <= b < 10 for t in tables for b in t)
    plan = decode_plan(tables, [33, 16, 1], 16, [7, 8, 9])
    assert plan.is_decode and plan.positions == [32, 15, 0] and plan.context_lens == [33, 16, 1]
    assert plan.slot_mapping == [tables[0][2] * 16, tables[1][0] * 16 + 15, tables[2][0] * 16]
    assert plan.sample_rows == [0, 1, 2] and plan.cu_seqlens_q == [0, 1, 2, 3]
    assert plan.block_tables.tolist() == [tables[0], tables[1] + [0, 0], tables[2] + [0, 0]]


@pytest.fixture(scope="module")
def tiny_runner(tiny_model_dirs: dict[str, Path]) -> ModelRunner:
    path = tiny_model_dirs["tiny-qwen2"]
    config = EngineConfig(
        model=str(path),
        dtype="float32",
        device="cpu",
        max_model_len=128,
        enforce_eager=True,
        cache=CacheConfig(num_blocks=16),
    )
    return ModelRunner(config, ModelConfig.from_pretrained(path))


@pytest.mark.slow
def test_tp_group_returns_teacher_forced_logits(tiny_runner: ModelRunner) -> None:
    """The harness the GPU TP tests use: tp 2 (gloo, fp32) logits at every position equal tp 1's."""
    prompt = torch.randint(0, 512, (40,), generator=torch.Generator().manual_seed(1)).tolist()
    expected = teacher_forced_logits(tiny_runner, prompt)
    assert expected.shape == (40, 512)
    got = run_tp_group(tiny_runner.config, 2, None, teacher_forced_logits, prompt, timeout=120)
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=0)


def test_compare_greedy_flags_divergence_away_from_a_near_tie(tiny_runner: ModelRunner) -> None:
    prompt = [5, 6, 7, 8]
    logits = teacher_forced_logits(tiny_runner, prompt)[-1]
    ranked = logits.argsort(descending=True).tolist()
    want = [[ranked[0]]]
    assert compare_greedy(tiny_runner, [prompt], want, want) == (1, [])
    assert compare_greedy(tiny_runner, [prompt], [[ranked[1]]], want) == (0, [])  # second choice: a near-tie
    identical, bad = compare_greedy(tiny_runner, [prompt], [[ranked[-1]]], want)
    assert identical == 0 and len(bad) == 1 and "step 0" in bad[0]
    # The record behind the line: the reference's top 3 and how far the output's token fell.
    (record,) = divergences(tiny_runner, [prompt], [[ranked[-1]]], want)
    assert (record.request, record.step, record.got, record.want) == (0, 0, ranked[-1], ranked[0])
    assert record.top_ids == ranked[:3] and not record.near_tie
    assert record.gap == pytest.approx((logits[ranked[0]] - logits[ranked[-1]]).item())
    best = abs(record.top_logits[0])
    assert record.bf16_steps == pytest.approx(record.gap / 2.0 ** (math.floor(math.log2(best)) - 7))
    assert record.as_dict() == {  # the JSON record
        **vars(record),
        "gap": record.gap,
        "bf16_steps": record.bf16_steps,
        "near_tie": False,
    }
    # Outputs that stop early are flagged without a logit comparison.
    assert compare_greedy(tiny_runner, [prompt], [[]], want)[1] == ["request 0: 0 tokens against 1"]


def test_a_token_level_with_the_second_is_a_near_tie() -> None:
    """Three tokens within a rounding step: the reference lists one of two equal logits second."""
    level = Divergence(
        57,
        16,
        got=41344,
        want=133360,
        top_ids=[133360, 69240, 41344],
        top_logits=[3.328, 3.3125, 3.3125],
        got_logit=3.3125,
    )
    below = dataclasses.replace(level, got_logit=3.296875, top_logits=[3.328, 3.3125, 3.296875])
    assert level.near_tie and not below.near_tie


def test_batch_divergence_cpu_smoke(preset_cache: Path) -> None:
    """fp32 on the CPU: two batch limits give the same greedy tokens, and the JSON says so."""
    out = preset_cache / "divergence.json"
    batch_divergence.main(
        [
            "--model",
            "tiny-llama",
            "--device",
            "cpu",
            "--num-requests",
            "6",
            "--max-tokens",
            "6",
            "--max-model-len",
            "256",
            "--max-num-seqs",
            "6,2",
            "--out",
            str(out),
        ],
        standalone_mode=False,
    )
    result = json.loads(out.read_text())
    assert result["max_num_seqs"] == [6, 2] and result["identical"] == 6 and result["divergences"] == []
