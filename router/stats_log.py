"""The launcher's periodic line of what the cluster does, as vLLM's "Avg prompt throughput" line:
token rates since the last line, requests in flight, each group's queues and KV use, and the
prefix cache's hit rate over the interval. Only while the cluster works: an idle one stays quiet."""

from __future__ import annotations

from collections.abc import Mapping

# A group's report older than this is said to be: a leader reports between engine steps, so during
# a long step (a long prompt on a CPU) its queues are those before the step.
STALE_REPORT_S = 2.0


class StatsLog:
    """Call ``line(now, ...)`` once ``due(now)``: a line if the cluster did something since the
    last one (or holds requests), else None."""

    def __init__(self, interval: float, now: float) -> None:
        self.interval = interval
        self.since = now
        self.tokens = {"prompt": 0, "generated": 0}
        self.prefix: dict[str, tuple[int, int]] = {}  # group -> (queried, hit) at the last line

    def due(self, now: float) -> bool:
        return self.interval > 0 and now - self.since >= self.interval

    def line(
        self,
        now: float,
        tokens: Mapping[str, int],
        in_flight: int,
        groups: Mapping[str, Mapping[str, int]],
        entry_role: str,
        parked: int = 0,
        states: Mapping[str, str] | None = None,
        ages: Mapping[str, float] | None = None,
    ) -> str | None:
        """``tokens``: the router's cumulative ``token_counts``; ``groups``: each group's latest
        ``worker_stats``; the prefix cache's rate is the entry groups' (prefill or colocated);
        ``parked``: requests in flight that wait for a group of a role none serves now;
        ``states``: every known group's state (``GroupInfo.state``), so that a group that is not
        ready is named even with no report to show; ``ages``: seconds since each group's report."""
        if not self.due(now):
            return None
        elapsed = now - self.since
        prompt, generated = (tokens[k] - self.tokens[k] for k in ("prompt", "generated"))
        queried = hit = 0
        for name, g in groups.items():
            if not name.startswith(entry_role):
                continue
            now_queried, now_hit = g.get("prefix_queried_tokens", 0), g.get("prefix_hit_tokens", 0)
            was_queried, was_hit = self.prefix.get(name, (0, 0))
            if now_queried < was_queried:  # a restarted group counts from zero again
                was_queried = was_hit = 0
            queried += now_queried - was_queried
            hit += now_hit - was_hit
            self.prefix[name] = (now_queried, now_hit)
        self.since, self.tokens = now, dict(tokens)
        if not (prompt or generated or in_flight):
            return None
        parts = [
            f"prompt {prompt / elapsed:.1f} tok/s, generation {generated / elapsed:.1f} tok/s",
            f"{in_flight} request(s) in flight" + (f" ({parked} waiting for a group to serve them)" if parked else ""),
        ]
        states = states or {}
        for name in sorted(groups.keys() | states.keys(), key=lambda name: (not name.startswith(entry_role), name)):
            state = states.get(name, "ready")
            g = groups.get(name)
            if g is None:
                parts.append(f"{name}: {state}" + (", no report yet" if state == "ready" else ""))
                continue
            total = g.get("num_blocks", 0)
            kv = f"{(total - g.get('free_blocks', 0)) / total:.1%}" if total else "-"
            load = f"{g.get('running', 0)} running, {g.get('waiting', 0)} waiting, KV {kv}"
            age = (ages or {}).get(name, 0.0)
            if age > STALE_REPORT_S:
                load += f" ({age:.0f} s ago: in a long step)"
            parts.append(f"{name}: {load}" if state == "ready" else f"{name} ({state}): {load}")
        if queried:
            parts.append(f"prefix cache hit {hit / queried:.0%} of {queried} prompt tokens")
        return " | ".join(parts)
