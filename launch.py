"""Start a disaggregated prefill/decode cluster (or a colocated baseline) and serve clients.

    python launch.py --prefill-tp 2 --decode-tp 1            # serve on tcp://127.0.0.1:5555
    python launch.py --prefill-tp 2 --decode-tp 1 --demo     # answer a few prompts, then stop
    python launch.py --config configs/2p1d.yaml --port 6000  # a preset; flags override it

Ctrl-C or SIGTERM drains in-flight requests and exits 0.
"""

from __future__ import annotations

import statistics
import sys
import threading
import time

try:
    import click

    from pdserve.cluster.config import ClusterConfig
    from pdserve.cluster.launcher import Cluster, ClusterError
except ModuleNotFoundError as missing:  # run from a checkout that was never installed
    sys.exit(f"error: {missing.name} is not installed; run `pip install -e .` in the repository root first")

DEMO_PROMPTS = (
    "What is the capital of France?",
    "Write a haiku about a graphics card.",
    "In one sentence, why do language models cache keys and values?",
)


def run_demo(endpoint: str, prompts: tuple[str, ...], max_tokens: int) -> None:
    """Stream each prompt's answer through the client and print its latencies."""
    from pdserve.cluster.client import Chunk, Client

    with Client(endpoint, timeout=600) as client:
        for prompt in prompts:
            click.echo(f"\n>>> {prompt}")
            started = time.monotonic()
            arrivals: list[float] = []
            for message in client.stream(prompt, max_tokens=max_tokens, temperature=0.0):
                if isinstance(message, Chunk):
                    arrivals.extend([time.monotonic()] * len(message.token_ids))
                    sys.stdout.write(message.text)
                    sys.stdout.flush()
                else:
                    gaps = [b - a for a, b in zip(arrivals, arrivals[1:])]
                    itl = f"{statistics.mean(gaps) * 1e3:.1f} ms" if gaps else "n/a"
                    ttft = (arrivals[0] - started) * 1e3 if arrivals else float("nan")
                    transfer = message.timings.get("transfer")
                    click.echo(
                        f"\n[{message.usage['prompt_tokens']} prompt + {message.usage['completion_tokens']} generated, "
                        f"{message.finish_reason}] TTFT {ttft:.0f} ms, inter-token {itl} mean"
                        + (f", KV transfer {transfer * 1e3:.1f} ms" if transfer is not None else ""),
                        err=True,
                    )


@click.command(context_settings={"show_default": True})
@click.option("--config", "config_path", type=click.Path(exists=True, dir_okay=False),
              help="A cluster preset (configs/*.yaml); flags given here override it.")
@click.option("--model", default=None, help="'demo' (default), a shape preset (random weights) or a HF directory.")
@click.option("--mode", type=click.Choice(["disagg", "colocated"]), default=None, help="[default: disagg]")
@click.option("--prefill-tp", type=int, default=None, help="[default: 1]")
@click.option("--decode-tp", type=int, default=None, help="[default: 1]")
@click.option("--prefill-groups", type=int, default=None, help="[default: 1]")
@click.option("--decode-groups", type=int, default=None, help="[default: 1]")
@click.option("--colocated-groups", type=int, default=None, help="colocated mode [default: 1]")
@click.option("--colocated-tp", type=int, default=None, help="colocated mode [default: 1]")
@click.option("--transfer", type=click.Choice(["auto", "nccl", "nccl-async", "gloo", "gloo-async"]), default=None,
              help="KV transfer backend [default: nccl-async on GPUs, gloo on CPU]")
@click.option("--transfer-layer-groups", type=int, default=None,
              help="KV messages per request and destination rank, each a range of layers [default: 1]")
@click.option("--transfer-staging-mib", type=float, default=None,
              help="KV buffers a rank may hold for transfers in flight, MiB [default: 4096]")
@click.option("--devices", default=None, help="Comma-separated GPU ids [default: all visible]")
@click.option("--host", default=None, help="[default: 127.0.0.1]")
@click.option("--port", type=int, default=None, help="[default: 5555]")
@click.option("--max-model-len", type=int, default=None, help="[default: 4096]")
@click.option("--kv-memory-fraction", "gpu_memory_utilization", type=float, default=None,
              help="Fraction of each GPU for weights + KV cache [default: 0.85]")
@click.option("--num-blocks", type=int, default=None, help="Fixed KV blocks per rank [default: sized from memory]")
@click.option("--max-num-seqs", type=int, default=None, help="Most sequences a group runs at once [default: 256]")
@click.option("--graph-max-batch", "cuda_graph_max_batch", type=int, default=None,
              help="Largest CUDA-graph decode batch [default: 256]")
@click.option("--graph-max-prefill-tokens", "cuda_graph_max_prefill_tokens", type=int, default=None,
              help="Largest CUDA-graph prefill step in tokens, 0 for none [default: 2048]")
@click.option("--graph-max-prefill-seqs", "cuda_graph_max_prefill_seqs", type=int, default=None,
              help="Most sequences (decodes included) in a CUDA-graph prefill or mixed step [default: 256]")
@click.option("--enforce-eager", is_flag=True, default=None, help="No CUDA graphs.")
@click.option("--no-overlap", "overlap_scheduling", flag_value=False, default=None,
              help="Read each step's tokens back before planning the next (overlap is on by default).")
@click.option("--no-chunked-prefill", "enable_chunked_prefill", flag_value=False, default=None,
              help="Prefill whole prompts in their own steps (colocated baseline without chunking).")
@click.option("--dispatch", type=click.Choice(["round-robin", "least-tokens"]), default=None,
              help="[default: round-robin]")
@click.option("--drain-timeout", type=float, default=None, help="Seconds to finish in-flight requests on shutdown.")
@click.option("--demo", is_flag=True, help="Answer a few prompts through the client, then shut down.")
@click.option("--demo-max-tokens", type=int, default=48)
def main(config_path: str | None, devices: str | None, demo: bool, demo_max_tokens: int, **flags: object) -> None:
    overrides = {k: v for k, v in flags.items() if v is not None}
    if devices is not None:
        overrides["devices"] = tuple(int(d) for d in devices.split(",") if d.strip())
    try:
        config = ClusterConfig.from_yaml(config_path, **overrides) if config_path else ClusterConfig(**overrides)
    except (TypeError, ValueError) as e:
        raise click.UsageError(str(e)) from None
    cluster = Cluster(config)
    started = time.monotonic()
    try:
        cluster.start()
    except (ClusterError, ValueError, FileNotFoundError) as e:
        raise click.ClickException(str(e)) from None
    click.echo(f"ready in {time.monotonic() - started:.1f} s: {cluster.summary()}", err=True)
    click.echo(f"endpoint {cluster.endpoint}", err=True)
    finished = threading.Event()
    if demo:
        def demo_thread() -> None:
            try:
                run_demo(cluster.endpoint, DEMO_PROMPTS, demo_max_tokens)
            finally:
                finished.set()

        threading.Thread(target=demo_thread, daemon=True).start()
    try:
        cluster.serve(until=finished.is_set)
    except ClusterError as e:
        raise click.ClickException(str(e)) from None
    click.echo("stopped: every process exited cleanly", err=True)


if __name__ == "__main__":
    main()
