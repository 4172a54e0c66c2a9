"""Decode and prefill step times of the engine against Hugging Face transformers, one process.

    python -m pdserve.bench.decode --preset qwen2.5-1.5b --out results.json --plot decode.png
    python -m pdserve.bench.decode --from-json results.json --plot decode.png   # re-print and re-plot a run
    python -m pdserve.bench.decode --preset tiny-llama --device cpu --batch-sizes 1,2 --contexts 16,32 \\
        --prefill-lens 32 --iters 2          # CPU smoke run

What is timed (median of ``--iters`` calls after ``--warmup``; CUDA events on GPU):

* ours, decode: ``ModelRunner.run(plan)`` for a decode ``StepPlan`` of B sequences of context C
  (one new token each at position C-1, written to its slot), built straight on the runner's
  block pool (distinct, shuffled blocks holding random K/V). On CUDA ``run`` replays the
  captured graph of the batch's bucket; the call includes the host-side plan-to-tensor copies.
  The runner's max_model_len is the longest case plus one block (``--max-model-len``): graphs
  size their split-KV grid for it. "eager" is the same plan through ``runner.forward(*runner.inputs(plan))``, what
  ``run`` does with ``enforce_eager=True`` (its grid sized for the batch's own context).
* ours, prefill: ``ModelRunner.run`` of one prefill step (logits of each last token): on CUDA
  the replay of the prefill graph of its token bucket where one holds it (host-side copies
  included), and "eager" the same plan through ``runner.forward``, as for decode.
* HF, decode: one ``model(input_ids=[B, 1], past_key_values=StaticCache, logits_to_keep=1)``
  step (the argument is ``cache`` from transformers 5.24 on); the cache holds random K/V, is
  rewound to position C-1 before the timed run and advances one position per step, and
  ``max_cache_len = C + iters`` (what ``generate`` would allocate). On CUDA the step is
  ``model.get_compiled_call(config)``, the compiled forward (inductor, "reduce-overhead", i.e.
  CUDA graphs) that ``generate(cache_implementation="static")`` uses for its decode steps, with
  dynamic shapes by default to save compile time (``--hf compiled-static``: generate's own
  config, see ``HF_COMPILE_OPTIONS``); compile and graph recording happen in the untimed
  warm-up (``hf_warmup_s``). ``--hf eager`` times the plain forward.
* HF, generate (``--hf-generate``, batch-1 cases): ``model.generate(cache_implementation="static",
  do_sample=False)`` as a user calls it, the decode loop included; per-token time is
  (time for 1 + N tokens - time for 1 token) / N with a prompt of C-1 tokens, so its steps run at
  contexts C..C+N-1 (``--hf-generate-tokens``; the median over 5 such pairs, each long call
  followed by its short one, after a compiling warm-up).
* HF, prefill: one uncompiled forward of the same prompt(s) with ``use_cache=False`` and
  ``logits_to_keep=1`` (``generate`` runs its prefill uncompiled too).

The bandwidth floor of a decode step is (weight bytes + B * C * KV bytes per token) /
``H200_BANDWIDTH`` (the H200's copy rate); "% of floor" is floor / measured.
"""

from __future__ import annotations

import argparse
import gc
import inspect
import json
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import torch
import torch._dynamo
from tqdm import tqdm
from transformers import AutoModelForCausalLM, CompileConfig, StaticCache

from pdserve.bench.common import (
    H200_BANDWIDTH,
    add_step_timing_args,
    bench_parser,
    block_tables,
    blocks_for,
    command_line,
    fill_kv_random,
    fmt,
    format_table,
    kv_bytes_per_token,
    log_axis,
    metadata,
    model_dir,
    parse_ints,
    parse_step_timing_args,
    prefill_plan,
    pyplot,
    resolve_device,
    save_figure,
    summary,
    time_steps,
    uniform_decode_plan,
    weight_bytes,
    write_json,
)
from pdserve.engine.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig, parse_dtype
from pdserve.engine.model_runner import ModelRunner
from pdserve.engine.step_plan import StepPlan

_GENERATE_PAIRS = 5  # generate() timings: each a call of 1 + N tokens minus one of 1 token

# transformers' CompileConfig per --hf mode. "compiled-static" is exactly what generate() uses
# with a static cache, which compiles anew for every (batch, context). "compiled" marks shapes
# dynamic from the start, so far fewer compiles; its kernels differ only in the fused elementwise
# ops (matmuls and attention are library calls either way).
HF_COMPILE_OPTIONS: dict[str, dict[str, Any]] = {"compiled": {"dynamic": True}, "compiled-static": {}}


@dataclass
class Case:
    """One measured shape: a decode step of ``batch`` x context ``context``, or a prefill of
    ``batch`` prompts of ``context`` tokens each."""

    kind: str  # decode | prefill
    batch: int
    context: int
    results: dict[str, Any] = field(default_factory=dict)

    @property
    def name(self) -> str:
        if self.kind == "decode":
            return f"decode B={self.batch} C={self.context}"
        return f"prefill {self.batch}x{self.context}"

    def token_ids(self, vocab: int, seed: int) -> torch.Tensor:
        """The case's input tokens, ``[batch, 1]`` (decode) or ``[batch, context]``: the same
        for our engine and for transformers."""
        gen = torch.Generator().manual_seed(seed)
        return torch.randint(0, vocab, (self.batch, 1 if self.kind == "decode" else self.context), generator=gen)


def ours_ms(results: dict[str, Any]) -> float:
    """Our median time of a case: graph replays where they ran, else eager."""
    return results.get("ours_graph", results["ours_eager"])["median_ms"]


def parse_prefill_lens(text: str) -> list[int]:
    """``"512,2048"`` -> ``[512, 2048]``; empty for ``""`` (a decode-only run)."""
    return parse_ints(text) if text.strip() else []


def parse_prefill_batches(text: str) -> list[tuple[int, int]]:
    """``"8x512,4x256"`` -> ``[(8, 512), (4, 256)]``; empty for ``""``."""
    out = []
    for part in filter(None, (p.strip() for p in text.split(","))):
        count, _, length = part.partition("x")
        out.append((int(count), int(length)))
    if any(n < 1 or length < 1 for n, length in out):
        raise ValueError(f"prefill batches must look like 8x512, got {text!r}")
    return out


def build_runner(
    path: Path, device: torch.device, dtype: str, cases: Sequence[Case], block_size: int, max_model_len: int | None
) -> ModelRunner:
    """A runner whose pool holds the largest case and whose graphs cover the largest decode batch.

    ``max_model_len`` defaults to the longest case plus one block. The graphs size their
    split-KV grid for it, so serving with a far longer one (the model's own limit) costs short
    contexts extra, empty programs: pass it to measure that.
    """
    model_config = ModelConfig.from_pretrained(path)
    longest = max(c.context for c in cases)
    if longest > model_config.max_position_embeddings:
        raise ValueError(f"context {longest} exceeds the model's {model_config.max_position_embeddings} positions")
    if max_model_len is None:
        max_model_len = min(longest + block_size, model_config.max_position_embeddings)
    elif max_model_len < longest:
        raise ValueError(f"--max-model-len {max_model_len} is shorter than the longest case ({longest})")
    decode = [c for c in cases if c.kind == "decode"]
    max_batch = max([c.batch for c in decode], default=1)
    num_blocks = max(c.batch * blocks_for(c.context, block_size) for c in cases)
    max_tokens = max(c.batch * (1 if c.kind == "decode" else c.context) for c in cases)
    config = EngineConfig(
        model=str(path),
        dtype=dtype,
        device=str(device),
        max_model_len=max_model_len,
        cuda_graph_max_batch=max_batch,
        cache=CacheConfig(block_size=block_size, num_blocks=num_blocks),
        scheduler=SchedulerConfig(max_num_seqs=max_batch, max_num_batched_tokens=max(max_tokens, max_batch)),
    )
    return ModelRunner(config, model_config)


def run_ours(runner: ModelRunner, cases: Sequence[Case], warmup: int, iters: int, seed: int, progress: tqdm) -> None:
    """Time every case on ``runner``; results go into ``case.results``."""
    fill_kv_random(runner, seed)
    gen = torch.Generator().manual_seed(seed)
    vocab, bs = runner.model_config.vocab_size, runner.block_size
    w_bytes, kv_token = weight_bytes(runner), kv_bytes_per_token(runner)

    def timed(fn: Callable[[], Any]) -> dict[str, float]:
        return summary(time_steps(fn, runner.device, warmup, iters))

    def eager(plan: StepPlan) -> torch.Tensor | None:
        return runner.forward(*runner.inputs(plan))

    for case in cases:
        progress.set_postfix_str(f"ours {case.name}")
        tokens = case.token_ids(vocab, seed)
        if case.kind == "decode":
            plan = uniform_decode_plan(runner, tokens[:, 0].tolist(), case.context, gen)
            if runner.graph_runner is not None:
                assert runner.graph_runner.can_run(plan), "the decode batch must fit a captured bucket"
                case.results["ours_graph"] = timed(partial(runner.run, plan))
            case.results["ours_eager"] = timed(partial(eager, plan))
            kv_read = case.batch * case.context * kv_token
            floor_ms = (w_bytes + kv_read) / H200_BANDWIDTH * 1e3
            best = ours_ms(case.results)
            case.results.update(
                kv_bytes_read=kv_read,
                floor_ms=floor_ms,
                floor_fraction=floor_ms / best,
                tokens_per_s=case.batch / best * 1e3,
            )
        else:
            tables = block_tables([case.context] * case.batch, bs, runner.num_blocks, gen)
            plan = prefill_plan(tables, tokens.tolist(), bs)
            if runner.prefill_graph_runner is not None and runner.prefill_graph_runner.can_run(plan):
                case.results["ours_graph"] = timed(partial(runner.run, plan))
            case.results["ours_eager"] = timed(partial(eager, plan))
            best = ours_ms(case.results)
            case.results["tokens_per_s"] = case.batch * case.context / best * 1e3
        progress.update()


def time_hf_decode(
    step: Callable[[], Any], cache: StaticCache, position: int, device: torch.device, warmup: int, iters: int
) -> dict[str, Any]:
    """Time ``step`` on a filled static cache whose next write goes to ``position``."""
    for layer in cache.layers:
        layer.keys.normal_()
        layer.values.normal_()

    def rewind() -> None:
        for layer in cache.layers:
            layer.cumulative_length.fill_(position)

    start = time.perf_counter()
    for _ in range(max(warmup, 3)):  # compile, record the graph, replay once
        rewind()
        step()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    warmup_s = time.perf_counter() - start
    rewind()
    return {"hf_warmup_s": warmup_s, "hf": summary(time_steps(step, device, 0, iters))}


def time_hf_generate(model: Any, prompt: torch.Tensor, new_tokens: int, device: torch.device) -> dict[str, Any]:
    """Per-token decode time of ``generate`` with a static cache (see the module docstring)."""

    def seconds(n: int) -> float:
        start = time.perf_counter()
        model.generate(
            prompt,
            attention_mask=torch.ones_like(prompt),
            max_new_tokens=n,
            min_new_tokens=n,
            do_sample=False,
            cache_implementation="static",
            pad_token_id=0,
        )
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        return time.perf_counter() - start

    start = time.perf_counter()
    seconds(1 + new_tokens)  # compiles the decode step and records its graph
    seconds(1)
    warmup_s = time.perf_counter() - start
    # Each long call paired with the short one right after it: a difference of two separate
    # medians goes negative when the host's load changes between the two series.
    extra = statistics.median(seconds(1 + new_tokens) - seconds(1) for _ in range(_GENERATE_PAIRS))
    return {
        "hf_generate": {"median_ms": extra / new_tokens * 1e3},
        "hf_generate_warmup_s": warmup_s,
        "hf_generate_tokens": new_tokens,
    }


def run_hf(
    path: Path,
    device: torch.device,
    dtype: torch.dtype,
    mode: str,
    cases: Sequence[Case],
    warmup: int,
    iters: int,
    seed: int,
    generate_tokens: int,
    progress: tqdm,
) -> None:
    """Time every case on transformers' model of the same checkpoint (see the module docstring)."""
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(device).eval()
    # transformers 5.24 renamed the forward's `past_key_values` to `cache` (5.17 has the former).
    cache_arg = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    step_fn = model.__call__
    if mode in HF_COMPILE_OPTIONS:
        # Every static shape compiles anew: without room for that many recompilations dynamo
        # would silently fall back to eager for the later cases.
        torch._dynamo.config.recompile_limit = 64
        torch._dynamo.config.accumulated_recompile_limit = 1024
        step_fn = model.get_compiled_call(CompileConfig(**HF_COMPILE_OPTIONS[mode]))
    vocab = model.config.vocab_size
    for case in cases:
        progress.set_postfix_str(f"HF {case.name}")
        ids = case.token_ids(vocab, seed).to(device)
        try:
            with torch.no_grad():
                if case.kind == "decode":
                    cache = StaticCache(config=model.config, max_cache_len=case.context + iters)
                    # The first, uncompiled call allocates the cache (as generate's prefill does).
                    model(input_ids=ids, **{cache_arg: cache}, use_cache=True, logits_to_keep=1)
                    step = partial(step_fn, input_ids=ids, **{cache_arg: cache}, use_cache=True, logits_to_keep=1)
                    case.results.update(time_hf_decode(step, cache, case.context - 1, device, warmup, iters))
                    del cache, step
                    if generate_tokens and case.batch == 1:
                        prompt = torch.randint(0, vocab, (1, case.context - 1), device=device)
                        case.results.update(time_hf_generate(model, prompt, generate_tokens, device))
                        case.results["speedup_vs_hf_generate"] = case.results["hf_generate"]["median_ms"] / ours_ms(
                            case.results
                        )
                else:
                    prefill = partial(model, input_ids=ids, use_cache=False, logits_to_keep=1)
                    case.results["hf"] = summary(time_steps(prefill, device, warmup, iters))
        except Exception as error:  # noqa: BLE001 (one failed baseline, e.g. OOM, must not lose the rest)
            case.results["hf_error"] = f"{type(error).__name__}: {error}"
            tqdm.write(f"HF {case.name} failed: {case.results['hf_error']}")
        if "hf" in case.results:
            case.results["speedup_vs_hf"] = case.results["hf"]["median_ms"] / ours_ms(case.results)
        if device.type == "cuda":
            torch.cuda.empty_cache()
        progress.update()


def table(cases: Sequence[Case]) -> str:
    def median(case: Case, key: str) -> float | None:
        entry = case.results.get(key)
        return None if entry is None else entry["median_ms"]

    def percent(value: float | None) -> str:
        return "-" if value is None else f"{100 * value:.0f}%"

    rows = []
    for c in cases:
        r = c.results
        hf = "error" if "hf_error" in r else fmt(median(c, "hf"))
        rows.append(
            [
                c.name,
                fmt(median(c, "ours_graph")),
                fmt(median(c, "ours_eager")),
                fmt(r.get("tokens_per_s"), 0),
                hf,
                fmt(r.get("speedup_vs_hf"), 2),
                fmt(median(c, "hf_generate")),
                fmt(r.get("speedup_vs_hf_generate"), 2),
                fmt(r.get("floor_ms")),
                percent(r.get("floor_fraction")),
            ]
        )
    headers = [
        "case",
        "ours graph ms",
        "ours eager ms",
        "ours tok/s",
        "HF ms",
        "HF/ours",
        "HF generate ms",
        "HF gen/ours",
        "floor ms",
        "% of floor",
    ]
    return format_table(headers, rows)


def write_plot(result: dict[str, Any], path: Path) -> Path | None:
    """A PNG of a result's decode cases against batch size, a colour per context: the step time
    (ours: graph replays, eager where no graph ran; transformers' step when measured; the
    bandwidth floor dashed) and the fraction of the floor reached; says where. None, with a
    warning, when matplotlib is not installed."""
    plt = pyplot()
    if plt is None:
        return None
    decodes = [c for c in result["cases"] if c["kind"] == "decode"]
    contexts = sorted({c["context"] for c in decodes})
    batches = sorted({c["batch"] for c in decodes})
    fig, (time_ax, floor_ax) = plt.subplots(1, 2, figsize=(11, 4.2))
    for i, context in enumerate(contexts):
        color = f"C{i}"
        rows = sorted((c for c in decodes if c["context"] == context), key=lambda c: c["batch"])
        ours = [(c["batch"], ours_ms(c)) for c in rows]
        hf = [(c["batch"], c["hf"]["median_ms"]) for c in rows if "hf" in c]
        time_ax.plot(*zip(*ours), "o-", color=color, label=f"ours, C={context}")
        if hf:
            time_ax.plot(*zip(*hf), "s:", color=color, markerfacecolor="none", label=f"transformers, C={context}")
        time_ax.plot(
            [c["batch"] for c in rows],
            [c["floor_ms"] for c in rows],
            "--",
            color=color,
            alpha=0.6,
            label=f"bandwidth floor, C={context}",
        )
        floor_ax.plot(
            [c["batch"] for c in rows],
            [100 * c["floor_fraction"] for c in rows],
            "o-",
            color=color,
            label=f"C={context}",
        )
    log_axis(time_ax, time_ax.yaxis)  # transformers' large batches sit an order of magnitude above
    time_ax.set_ylabel("decode step (ms)")
    time_ax.set_title("decode step time")
    floor_ax.set_ylabel("% of the bandwidth floor")
    floor_ax.set_ylim(0, 100)
    floor_ax.set_title("bandwidth floor / step time")
    for ax in (time_ax, floor_ax):
        ax.set_xscale("log", base=2)
        ax.set_xticks(batches, [str(b) for b in batches])
        ax.set_xlabel("batch size (sequences)")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize="small")
    meta = result["metadata"]
    fig.suptitle(
        f"{meta.get('preset') or meta.get('model_dir')}, {meta['dtype']}, {meta['device']} ({meta['date'][:10]})",
        fontsize="medium",
    )
    save_figure(plt, fig, path)
    print(f"wrote {path}")
    return path


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = bench_parser("decode", __doc__)
    parser.add_argument("--preset", default="qwen2.5-1.5b", help="model-shape preset with random weights")
    parser.add_argument("--model", help="a Hugging Face model directory (instead of --preset)")
    parser.add_argument("--device", default="auto", help="auto, cpu, cuda or cuda:N")
    parser.add_argument("--dtype", help="compute dtype (default bfloat16 on CUDA, float32 on CPU)")
    parser.add_argument("--batch-sizes", default="1,8,32,128", type=parse_ints, help="decode batch sizes")
    parser.add_argument("--contexts", default="128,2048", type=parse_ints, help="decode context lengths")
    parser.add_argument(
        "--prefill-lens", default="2048", type=parse_prefill_lens, help="single-prompt prefill lengths ('' for none)"
    )
    parser.add_argument(
        "--prefill-batches",
        default="8x512",
        type=parse_prefill_batches,
        help="batched prefills, COUNTxLENGTH[,...] ('' for none)",
    )
    parser.add_argument(
        "--hf",
        choices=[*HF_COMPILE_OPTIONS, "eager", "off"],
        help="transformers baseline (default: compiled on CUDA, eager on CPU)",
    )
    parser.add_argument(
        "--hf-generate",
        action="store_true",
        help="also time transformers' generate() with a static cache, batch-1 cases",
    )
    parser.add_argument("--hf-generate-tokens", default=64, type=int, help="decode tokens per timed generate")
    parser.add_argument(
        "--max-model-len", type=int, help="the runner's max_model_len (default: longest case + one block)"
    )
    parser.add_argument("--plot", type=Path, help="write a PNG of the decode cases here (needs matplotlib)")
    parser.add_argument(
        "--from-json", type=Path, help="measure nothing: print the table (and --plot) of an earlier run's --out file"
    )
    add_step_timing_args(parser)
    return parse_step_timing_args(parser, argv)


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    if args.from_json is not None:
        result = json.loads(args.from_json.read_text())
        cases = [
            Case(
                c["kind"],
                c["batch"],
                c["context"],
                {k: v for k, v in c.items() if k not in ("case", "kind", "batch", "context")},
            )
            for c in result["cases"]
        ]
        print(table(cases))
        if args.plot is not None:
            write_plot(result, args.plot)
        return result
    device = resolve_device(args.device)
    dtype = args.dtype or ("bfloat16" if device.type == "cuda" else "float32")
    hf_mode = args.hf or ("compiled" if device.type == "cuda" else "eager")
    path = model_dir(args.preset, args.model, "bfloat16", device)
    cases = [Case("decode", b, c) for c in args.contexts for b in args.batch_sizes]
    cases += [Case("prefill", 1, n) for n in args.prefill_lens]
    cases += [Case("prefill", count, length) for count, length in args.prefill_batches]

    runs = 2 if hf_mode != "off" else 1
    with tqdm(total=runs * len(cases), unit="case", desc="pdserve.bench.decode") as progress:
        runner = build_runner(path, device, dtype, cases, args.block_size, args.max_model_len)
        info = {
            "max_model_len": runner.max_model_len,
            "num_blocks": runner.num_blocks,
            "graph_buckets": runner.graph_runner.buckets if runner.graph_runner else None,
            "weight_bytes": weight_bytes(runner),
            "kv_bytes_per_token": kv_bytes_per_token(runner),
        }
        run_ours(runner, cases, args.warmup, args.iters, args.seed, progress)
        tqdm.write(table(cases))  # ours first: the baseline's compiles take minutes
        runner.close()  # frees the graphs; the weights and pool go with the runner
        del runner
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
        if hf_mode != "off":
            run_hf(
                path,
                device,
                parse_dtype(dtype),
                hf_mode,
                cases,
                args.warmup,
                args.iters,
                args.seed,
                args.hf_generate_tokens if args.hf_generate else 0,
                progress,
            )

    result = {
        "metadata": metadata(
            device,
            command_line("pdserve.bench.decode", argv),
            preset=None if args.model else args.preset,
            model_dir=str(path),
            dtype=dtype,
            hf_mode=hf_mode,
            hf_compile=HF_COMPILE_OPTIONS.get(hf_mode),
            iters=args.iters,
            warmup=args.warmup,
            block_size=args.block_size,
            bandwidth_bytes_per_s=H200_BANDWIDTH,
            **info,
        ),
        "cases": [{"case": c.name, "kind": c.kind, "batch": c.batch, "context": c.context, **c.results} for c in cases],
    }
    print(table(cases))
    write_json(result, args.out)
    if args.plot is not None:
        write_plot(result, args.plot)
    return result


if __name__ == "__main__":
    main()
