"""How far greedy decoding of one engine moves when only the batch composition changes.

    python -m pdserve.bench.batch_divergence --model qwen2.5-1.5b --max-num-seqs 64,8 --out divergence.json

Runs the same greedy requests through the single-process engine twice, with two batch limits
(so each step's batch, and with it the rounding of every matmul, differs), and reports each
request's first divergence with the first engine's top-3 logits there (teacher-forced) and the
gap between its best token and the one the second run took. This is the noise floor for the
cluster's agreement checks: a disaggregated or colocated cluster batches requests differently
from the reference engine too, so its bf16 divergences should look like these.
"""

from __future__ import annotations

import json
import random
import statistics
from pathlib import Path

import click
import torch

from pdserve.bench.common import divergences, write_json
from pdserve.engine.config import CacheConfig, EngineConfig, SchedulerConfig
from pdserve.engine.engine import LLMEngine
from pdserve.engine.presets import resolve_model
from pdserve.engine.sampling import SamplingParams


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--model", default="qwen2.5-1.5b", show_default=True, help="preset name or model directory")
@click.option("--device", default="cuda:0", show_default=True)
@click.option("--num-requests", default=64, show_default=True)
@click.option("--max-tokens", default=64, show_default=True)
@click.option("--max-model-len", default=4096, show_default=True)
@click.option("--max-num-seqs", default="64,8", show_default=True, help="the two batch limits, reference first")
@click.option("--gpu-memory-utilization", default=0.3, show_default=True, help="each engine's share")
@click.option("--out", type=click.Path(dir_okay=False, path_type=Path))
def main(
    model: str,
    device: str,
    num_requests: int,
    max_tokens: int,
    max_model_len: int,
    max_num_seqs: str,
    gpu_memory_utilization: float,
    out: Path | None,
) -> None:
    if torch.device(device).type == "cuda" and not torch.cuda.is_available():
        raise click.UsageError(f"--device {device} needs a GPU and none is visible; --device cpu runs on the CPU")
    limits = [int(n) for n in max_num_seqs.split(",")]
    if len(limits) != 2:
        raise click.BadParameter("give two batch limits, e.g. 64,8", param_hint="--max-num-seqs")
    path = str(resolve_model(model))
    vocab = json.loads((Path(path) / "config.json").read_text())["vocab_size"]
    rng = random.Random(0)
    lengths = [n for n in (16, 100, 500, 1000, 2000) if n + max_tokens <= max_model_len]
    prompts = [[rng.randrange(vocab) for _ in range(rng.choice(lengths))] for _ in range(num_requests)]
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    engines, outputs = [], []
    for limit in limits:
        engine = LLMEngine(
            EngineConfig(
                model=path,
                device=device,
                max_model_len=max_model_len,
                cache=CacheConfig(gpu_memory_utilization=gpu_memory_utilization),
                scheduler=SchedulerConfig(max_num_seqs=limit, max_num_batched_tokens=max(8192, limit)),
            )
        )
        outputs.append(engine.generate(prompts, params))
        engines.append(engine)
    reference, other = outputs
    found = divergences(engines[0].runner, prompts, other, reference)
    for engine in engines:
        engine.close()

    identical = sum(a == b for a, b in zip(other, reference))
    print(
        f"{num_requests} greedy requests, max_num_seqs {limits[0]} against {limits[1]}: {identical} identical, "
        f"{len(found)} diverge, {sum(not d.near_tie for d in found)} to a token outside the reference's top 2"
    )
    if found:
        gaps = [d.gap for d in found]
        print(
            f"gap below the reference's best token: median {statistics.median(gaps):.4f}, max {max(gaps):.4f}; "
            f"top-1 minus top-2 there: median {statistics.median(d.top_logits[0] - d.top_logits[1] for d in found):.4f}"
        )
        for d in found:
            if not d.near_tie:
                print("  " + d.describe())
    write_json(
        {
            "model": model,
            "device": device,
            "max_num_seqs": limits,
            "num_requests": num_requests,
            "max_tokens": max_tokens,
            "identical": identical,
            "divergences": [d.as_dict() for d in found],
        },
        out,
    )


if __name__ == "__main__":
    main()
