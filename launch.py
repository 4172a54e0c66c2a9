"""Command-line entry point.

Until the cluster lands (router + prefill/decode groups), this runs the engine in one process:
it loads the model (the embedded demo model by default), streams the answer to each prompt
and prints per-request timings.
"""

from __future__ import annotations

import statistics
import sys
import time

import click

DEFAULT_PROMPTS = (
    "What is the capital of France?",
    "Write a haiku about a graphics card.",
    "In one sentence, why do language models cache keys and values?",
)


@click.command()
@click.option("--model", default="demo", show_default=True,
              help="'demo', a random-weight preset name (configs/models), or a Hugging Face directory.")
@click.option("--prompt", "prompts", multiple=True, help="A prompt (repeatable). Default: three demo prompts.")
@click.option("--max-tokens", default=64, show_default=True, type=int)
@click.option("--temperature", default=0.0, show_default=True, type=float, help="0 is greedy.")
@click.option("--top-p", default=1.0, show_default=True, type=float)
@click.option("--top-k", default=-1, show_default=True, type=int, help="-1 disables top-k.")
@click.option("--seed", default=None, type=int, help="Per-request sampling seed.")
@click.option("--dtype", default="auto", show_default=True, help="auto: bfloat16 on CUDA, float32 on CPU.")
@click.option("--device", default="auto", show_default=True)
@click.option("--max-model-len", default=2048, show_default=True, type=int)
@click.option("--raw", is_flag=True, help="Send prompts as they are, without the chat template.")
def main(
    model: str, prompts: tuple[str, ...], max_tokens: int, temperature: float, top_p: float, top_k: int,
    seed: int | None, dtype: str, device: str, max_model_len: int, raw: bool,
) -> None:
    from transformers import AutoTokenizer

    from engine.config import EngineConfig
    from engine.presets import resolve_model
    from engine.detokenizer import IncrementalDetokenizer
    from engine.engine import LLMEngine
    from engine.sampling import RequestError, SamplingParams
    from engine.tokenization import encode_prompt

    model_dir = resolve_model(model)
    started = time.monotonic()
    engine = LLMEngine(EngineConfig(model=str(model_dir), dtype=dtype, device=device, max_model_len=max_model_len))
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    click.echo(f"loaded {model_dir.name} on {engine.runner.device} ({engine.runner.dtype}) "
               f"in {time.monotonic() - started:.1f} s; KV pool {engine.runner.num_blocks} blocks", err=True)
    try:
        params = SamplingParams(max_tokens=max_tokens, temperature=temperature, top_p=top_p, top_k=top_k, seed=seed)
    except RequestError as e:
        raise click.BadParameter(str(e)) from None
    for i, prompt in enumerate(prompts or DEFAULT_PROMPTS):
        token_ids = encode_prompt(tokenizer, prompt, chat=not raw)
        click.echo(f"\n>>> {prompt}")
        detok = IncrementalDetokenizer(tokenizer)
        submitted = time.monotonic()
        try:
            engine.add_request(f"cli-{i}", token_ids, params)
        except RequestError as e:
            click.echo(f"[rejected] {e}", err=True)
            continue
        token_times: list[float] = []
        reason = None
        while engine.has_unfinished():
            for out in engine.step():
                token_times.extend([time.monotonic()] * len(out.new_token_ids))
                sys.stdout.write(detok.add(out.new_token_ids))
                sys.stdout.flush()
                reason = out.finish_reason if out.finished else reason
        sys.stdout.write(detok.flush() + "\n")
        gaps = [b - a for a, b in zip(token_times, token_times[1:])]
        ttft = (token_times[0] - submitted) * 1e3 if token_times else float("nan")
        itl = statistics.mean(gaps) * 1e3 if gaps else float("nan")
        total = token_times[-1] - submitted if token_times else float("nan")
        click.echo(
            f"[{len(token_ids)} prompt tokens, {len(token_times)} generated, finish={reason}] "
            f"TTFT {ttft:.1f} ms, inter-token {itl:.1f} ms mean, {len(token_times) / total:.1f} tok/s",
            err=True,
        )


if __name__ == "__main__":
    main()
