"""Serve N concurrent greedy requests through real clusters and compare them with one engine.

    python -m pdserve.bench.cluster_check --model qwen2.5-1.5b --devices 0,1 --out check.json
    python -m pdserve.bench.cluster_check --model qwen2.5-1.5b --devices 0,1,2 --prefill-tp 2   # 2p1d
    python -m pdserve.bench.cluster_check --devices 0,0 --topologies disagg-cuda-ipc             # one GPU

For each topology (disaggregated with sync and async NCCL transfer and with CUDA IPC, a prefill
group of ``--prefill-tp`` ranks and a decode group of ``--decode-tp``; colocated, one TP-1 group
per distinct device), starts
``launch.py`` as a subprocess, submits every request at once (streaming), and records each
request's output tokens, time to first token and inter-token gaps. The reference is the
single-process engine on the first device with the same prompts. Greedy bf16 decoding may
legitimately diverge at a near-tie (different batch shapes round differently), so the report
gives exact matches, the matching prefix, and the divergences that are *not* near-ties: those
where the cluster's token is not in the reference's top 2 (nor level with its second) at the
first differing step (teacher-forced through the reference engine). Each divergence's logit gap
is also given in bf16 steps at the best logit (``Divergence.bf16_steps``): a rounding flip is a
few steps at most, and ``bench.batch_divergence`` (one engine, only its batch limit changed)
shows how far re-batching alone reaches. The JSON keeps every divergence with the reference's
top-3 logits there and the logit gap to the cluster's token.

``--topologies`` picks a subset (``colocated`` alone runs on one GPU; the disaggregated ones need
prefill-tp + decode-tp GPUs).
"""

from __future__ import annotations

import json
import random
import statistics
import tempfile
import time
from pathlib import Path

import click
import torch

from pdserve.bench.common import device_list, divergences, greedy_report
from pdserve.bench.compare import LaunchedCluster
from pdserve.bench.metrics import percentile
from pdserve.cluster.client import Chunk, Client
from pdserve.engine.config import CacheConfig, EngineConfig
from pdserve.engine.engine import LLMEngine
from pdserve.engine.presets import resolve_model
from pdserve.engine.sampling import SamplingParams


def serve(endpoint: str, prompts: list[list[int]], max_tokens: int) -> list[dict]:
    """Submit every prompt at once; per request: tokens, TTFT and inter-token gaps (seconds)."""
    with Client(endpoint, timeout=600) as client:
        sent = time.monotonic()
        ids = [
            client.submit(token_ids=p, stream=True, max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
            for p in prompts
        ]
        records: dict[str, dict] = {i: {"arrivals": []} for i in ids}
        pending = set(ids)
        while pending:
            message = client.receive()
            record = records[message.request_id]
            if isinstance(message, Chunk):
                record["arrivals"].append(time.monotonic())
            elif message.type == "final":
                record.update(tokens=message.token_ids, timings=message.timings)
                pending.discard(message.request_id)
            else:
                raise RuntimeError(f"request failed: {message}")
    out = []
    for request_id in ids:
        arrivals = records[request_id]["arrivals"]
        out.append(
            {
                "tokens": records[request_id]["tokens"],
                "ttft": arrivals[0] - sent,
                "gaps": [b - a for a, b in zip(arrivals, arrivals[1:])],
                "transfer": records[request_id]["timings"].get("transfer"),
            }
        )
    return out


def agreement(reference: list[list[int]], got: list[list[int]]) -> dict[str, float]:
    prefixes = []
    for ref, out in zip(reference, got):
        same = next((i for i, (a, b) in enumerate(zip(ref, out)) if a != b), min(len(ref), len(out)))
        prefixes.append(same / max(1, len(ref)))
    return {
        "exact": sum(r == g for r, g in zip(reference, got)) / len(reference),
        "mean_prefix": statistics.mean(prefixes),
    }


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--model", default="qwen2.5-1.5b")
@click.option("--devices", default="0,1", show_default=True, help="GPU ids of the ranks; cpu (or empty): the CPU.")
@click.option("--num-requests", default=64, show_default=True)
@click.option("--max-tokens", default=64, show_default=True)
@click.option("--max-model-len", default=4096, show_default=True)
@click.option("--prefill-tp", default=1, show_default=True)
@click.option("--decode-tp", default=1, show_default=True)
@click.option("--topologies", help="comma-separated subset of the topologies (default: all for the devices)")
@click.option("--out", type=click.Path(dir_okay=False), default="cluster_check.json")
def main(
    model: str,
    devices: str,
    num_requests: int,
    max_tokens: int,
    max_model_len: int,
    prefill_tp: int,
    decode_tp: int,
    topologies: str | None,
    out: str,
) -> None:
    devices = device_list(devices)
    if devices and not torch.cuda.is_available():
        raise click.UsageError(f"--devices {devices} needs GPUs and none is visible; --devices cpu runs on the CPU")
    model_dir = str(resolve_model(model))
    vocab = json.loads((Path(model_dir) / "config.json").read_text())["vocab_size"]
    rng = random.Random(0)
    lengths = [n for n in (16, 100, 500, 1000, 2000) if n + max_tokens <= max_model_len]
    prompts = [[rng.randrange(vocab) for _ in range(rng.choice(lengths))] for _ in range(num_requests)]
    first_device = devices.split(",")[0] if devices else None
    # The reference stays resident (for the near-tie check), so it and the clusters share GPU 0.
    engine = LLMEngine(
        EngineConfig(
            model=model_dir,
            max_model_len=max_model_len,
            device=f"cuda:{first_device}" if first_device else "cpu",
            cache=CacheConfig(gpu_memory_utilization=0.3),
        )
    )
    reference = engine.generate(prompts, SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True))
    device_args = ["--devices", devices, "--gpu-memory-utilization", "0.55"] if devices else []
    disagg = ["--prefill-tp", str(prefill_tp), "--decode-tp", str(decode_tp)]
    num_devices = len(set(devices.split(","))) if devices else prefill_tp + decode_tp
    colocated = ["--mode", "colocated", "--colocated-groups", str(num_devices), *device_args]
    if devices:
        available = {
            "disagg-nccl": [*disagg, "--transfer", "nccl", *device_args],
            "disagg-nccl-async": [*disagg, "--transfer", "nccl-async", *device_args],
            "disagg-cuda-ipc": [*disagg, "--transfer", "cuda-ipc", *device_args],
            "colocated": colocated,
        }
    else:
        available = {"disagg-gloo": [*disagg, "--transfer", "gloo"], "colocated": colocated}
    chosen = topologies.split(",") if topologies else list(available)
    unknown = set(chosen) - set(available)
    if unknown:
        raise click.BadParameter(f"unknown topologies {sorted(unknown)}; choose from {sorted(available)}")
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name in chosen:
            args = ["--model", model, "--max-model-len", str(max_model_len), *available[name]]
            with LaunchedCluster(args, Path(tmp) / f"{name}.log", start_timeout=600) as cluster:
                records = serve(cluster.endpoint, prompts, max_tokens)
                code = cluster.stop()
            gaps = [g for r in records for g in r["gaps"]]
            ttfts = [r["ttft"] for r in records]
            transfers = [r["transfer"] for r in records if r["transfer"] is not None]
            outputs = [r["tokens"] for r in records]
            found = divergences(engine.runner, prompts, outputs, reference)
            _, not_near_ties = greedy_report(outputs, reference, found)
            results[name] = {
                "exit_code": code,
                **agreement(reference, outputs),
                "divergences_not_near_ties": not_near_ties,
                "max_divergence_bf16_steps": max((d.bf16_steps for d in found), default=0.0),
                "divergences": [d.as_dict() for d in found],
                "ttft_ms": {q: percentile(ttfts, q) * 1e3 for q in (50, 90, 99)},
                "itl_ms": {q: percentile(gaps, q) * 1e3 if gaps else float("nan") for q in (50, 90, 99)},
                "transfer_ms_mean": statistics.mean(transfers) * 1e3 if transfers else None,
            }
    print(f"{num_requests} concurrent requests, prompts of {lengths} tokens, {max_tokens} output tokens each")
    print(
        f"{'topology':20} {'exit':>4} {'exact':>6} {'prefix':>7} {'bad':>4} {'TTFT p50':>9} {'p99':>8} "
        f"{'ITL p50':>8} {'p90':>7} {'p99':>7} {'xfer ms':>8} {'max bf16 steps':>14}"
    )
    for name, r in results.items():
        xfer = f"{r['transfer_ms_mean']:.2f}" if r["transfer_ms_mean"] is not None else "-"
        print(
            f"{name:20} {r['exit_code']:>4} {r['exact']:>6.2f} {r['mean_prefix']:>7.3f} "
            f"{len(r['divergences_not_near_ties']):>4} {r['ttft_ms'][50]:>9.1f} "
            f"{r['ttft_ms'][99]:>8.1f} {r['itl_ms'][50]:>8.2f} {r['itl_ms'][90]:>7.2f} {r['itl_ms'][99]:>7.2f} "
            f"{xfer:>8} {r['max_divergence_bf16_steps']:>14.1f}"
        )
    for name, r in results.items():
        gaps = sorted(d["gap"] for d in r["divergences"])
        if gaps:
            print(
                f"{name}: {len(gaps)} divergences; the cluster's token scored below the reference's best by "
                f"median {statistics.median(gaps):.3f}, max {gaps[-1]:.3f} logits (top-1 minus top-2 there: "
                f"median {statistics.median(d['top_logits'][0] - d['top_logits'][1] for d in r['divergences']):.3f})"
            )
    Path(out).write_text(
        json.dumps(
            {
                "model": model,
                "devices": devices,
                "num_requests": num_requests,
                "max_tokens": max_tokens,
                "results": results,
            },
            indent=2,
        )
    )


if __name__ == "__main__":
    main()
