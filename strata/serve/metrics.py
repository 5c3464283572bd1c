"""Prometheus metrics of the daemon (prometheus-client), one registry per app, served by GET /metrics."""
from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

# seconds; a 135M model on CPU answers in ms, a 30B one on a busy GPU in seconds
TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
TOKEN_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.56)
# seconds a request spends outside the model before its first token (parse, render, tokenize, plan, checkpoints, ...)
TURN_BUCKETS = (0.0005, 0.001, 0.002, 0.003, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 1.0)


class Metrics:
    """All series; names start with strata_. Counters are thread-safe (the engine thread updates them)."""

    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        self.requests = Counter("strata_requests", "HTTP requests answered, by route and status code",
                                ["route", "status"], registry=r)
        self.finished = Counter("strata_generations", "Generations finished, by finish reason",
                                ["finish_reason"], registry=r)
        self.prompt_tokens = Counter("strata_prompt_tokens", "Prompt tokens read by the model (prefill)",
                                     registry=r)
        self.generated_tokens = Counter("strata_generated_tokens", "Tokens generated (decode)", registry=r)
        self.ttft = Histogram("strata_time_to_first_token_seconds",
                              "Time from accepting a request to its first generated token, queue wait included",
                              buckets=TTFT_BUCKETS, registry=r)
        self.token_latency = Histogram("strata_time_per_output_token_seconds",
                                       "Time between consecutive generated tokens", buckets=TOKEN_BUCKETS,
                                       registry=r)
        self.queue_depth = Gauge("strata_queue_depth", "Requests waiting for the engine", registry=r)
        self.disk_tier_bytes = Gauge("strata_disk_tier_bytes", "Bytes of the disk tier's files: parked conversations "
                                     "and spilled checkpoints (--conversation-cache-dir)", registry=r)
        self.disk_tier_budget = Gauge("strata_disk_tier_budget_bytes",
                                      "The disk tier's byte budget (--conversation-cache-disk-mib; 0: no disk tier)",
                                      registry=r)
        self.responses_store_bytes = Gauge("strata_responses_store_bytes",
                                           "Bytes of the kept /v1/responses (--responses-store-mib)", registry=r)
        self.session_files_bytes = Gauge("strata_session_files_bytes",
                                         "Bytes of the regular files in --slot-save-path (session files)", registry=r)
        self.session_quota_bytes = Gauge("strata_session_files_quota_bytes",
                                         "The session directory's quota (--slot-quota-mib; 0: none)", registry=r)
        self.connections = Gauge("strata_connections_open", "Open connections, by listener", ["listener"],
                                 registry=r)
        self.running = Gauge("strata_requests_running", "Requests being generated now (at most one per request "
                             "slot, --parallel)", registry=r)
        self.cache_hits = Counter("strata_checkpoint_hits",
                                  "Generations that resumed from earlier work, by how (live / checkpoint / resident / slot / "
                                  "park / disk / session / choice: an n > 1 request's later choices)",
                                  ["resume_from"], registry=r)
        self.cache_misses = Counter("strata_checkpoint_misses", "Requests that read their prompt from token 0",
                                    registry=r)
        self.tokens_saved = Counter("strata_checkpoint_tokens_saved",
                                    "Prompt tokens not read because they were resumed (timings.cache_n)",
                                    registry=r)

        self.turn_outside = Histogram("strata_turn_outside_model_seconds",
                                      "Time from a chat or completions request's arrival (/v1/chat/completions, "
                                      "/v1/completions) to its first token leaving, minus the model's forward calls "
                                      "(its own, and with several slots the others' in the same engine steps; queue "
                                      "wait included)", buckets=TURN_BUCKETS,
                                      registry=r)
        self.turn_phase = Counter("strata_turn_phase_seconds",
                                  "Time of chat and completions requests up to their first token, by phase "
                                  "(parse, render, tokenize, queue, plan, model, slots, checkpoint, sample, write, "
                                  "other)", ["phase"],
                                  registry=r)

        self.spec_drafted = Counter("strata_spec_drafted_tokens", "Tokens drafted (--spec: the MTP head or lookup)",
                                    registry=r)
        self.spec_accepted = Counter("strata_spec_accepted_tokens", "Drafted tokens a verify kept", registry=r)
        self.spec_verifies = Counter("strata_spec_verifies", "Verifies of drafted tokens run", registry=r)
        self.spec_rate = Gauge("strata_spec_acceptance_rate", "Drafted tokens kept / drafted, since the start",
                               registry=r)
        self.spec_mean = Gauge("strata_spec_mean_accepted_length",
                               "Tokens emitted per verify (the drafts kept and the one each verify adds), since the "
                               "start", registry=r)
        self._spec = [0, 0, 0]         # drafted, accepted, verifies

        self.moe_tiers: list[tuple[int, dict]] = []      # (stage, its expert tier's status), set before a scrape
        r.register(_MoeTierCollector(self))
        # the request slots: (slots, busy, waiting, Scheduler.stats), set before a scrape
        self.slots: tuple[int, int, int, dict] | None = None
        r.register(_SlotCollector(self))

    def observe_turn(self, turn: dict) -> None:
        """Count one request's TurnClock report (strata.engine.turn_clock)."""
        self.turn_outside.observe(max(0.0, turn["outside_model_ms"]) / 1e3)
        for name, ms in turn["phases_ms"].items():
            self.turn_phase.labels(phase=name).inc(max(0.0, ms) / 1e3)
        self.turn_phase.labels(phase="other").inc(max(0.0, turn["other_ms"]) / 1e3)

    def observe_final(self, usage: dict, timings: dict, strata: dict, finish_reason: str) -> None:
        """Count one finished generation from its FinalEvent fields."""
        self.finished.labels(finish_reason=finish_reason).inc()
        self.prompt_tokens.inc(max(0, int(timings.get("prompt_n", 0) or 0)))
        self.generated_tokens.inc(max(0, int(timings.get("predicted_n", usage.get("completion_tokens", 0)) or 0)))
        d, a, v = (max(0, int(timings.get(k, 0) or 0)) for k in ("draft_n", "draft_n_accepted", "draft_verifies"))
        if v:
            self.spec_drafted.inc(d)
            self.spec_accepted.inc(a)
            self.spec_verifies.inc(v)
            t = self._spec
            t[0], t[1], t[2] = t[0] + d, t[1] + a, t[2] + v
            self.spec_rate.set(t[1] / t[0] if t[0] else 0.0)
            self.spec_mean.set((t[1] + t[2]) / t[2])
        cache_n = int(timings.get("cache_n", 0) or 0)
        how = (strata or {}).get("resume_from") or ("checkpoint" if cache_n else "none")
        if cache_n > 0 and how != "none":
            self.cache_hits.labels(resume_from=how).inc()
            self.tokens_saved.inc(cache_n)
        else:
            self.cache_misses.inc()

    def observe_session_files(self, usage: dict | None) -> None:
        """The session directory's use (ConversationFiles.usage), set before a scrape."""
        if usage and usage.get("bytes") is not None:
            self.session_files_bytes.set(usage["bytes"])
        self.session_quota_bytes.set((usage or {}).get("quota_bytes") or 0)

    def render(self) -> bytes:
        return generate_latest(self.registry)


#: the expert tier's per-layer counters: (metric suffix, status key, help)
MOE_COUNTERS = (("expert_hits", "hits", "Decoded tokens' routings to an expert resident in a VRAM slot"),
                ("expert_misses", "misses", "Decoded tokens' routings to an expert read from host RAM"),
                ("expert_prefill_hits", "prefill_hits", "Prompt tokens' routings to a resident expert"),
                ("expert_prefill_misses", "prefill_misses",
                 "Prompt tokens' routings to an expert not resident (host RAM or a prompt's lent slots)"),
                ("expert_swaps", "swaps", "Experts copied into VRAM slots (swaps, slots given back after a loan)"),
                ("expert_staged", "staged", "Experts staged into lent slots for prefills"),
                ("expert_bytes_moved", "bytes_moved", "Bytes copied from host RAM to the expert slots"))


class _MoeTierCollector:
    """The expert tier's numbers per stage and layer (``Metrics.moe_tiers``, refreshed by the /metrics route)."""

    def __init__(self, metrics: Metrics):
        self.metrics = metrics

    def collect(self):
        fams = [(CounterMetricFamily(f"strata_moe_{name}", text, labels=["stage", "layer"]), key)
                for name, key, text in MOE_COUNTERS]
        res = GaugeMetricFamily("strata_moe_resident_experts", "Experts resident in VRAM slots",
                                labels=["stage", "layer"])
        for stage, tier in self.metrics.moe_tiers:
            for L in tier.get("layers", []):
                labels = [str(stage), str(L["layer"])]
                for fam, key in fams:
                    fam.add_metric(labels, float(L.get(key, 0)))
                res.add_metric(labels, float(len(L.get("resident", []))))
        for fam, _ in fams:
            yield fam
        yield res


#: the engine step's counters (Scheduler.stats key, metric suffix, help)
STEP_COUNTERS = (("steps", "engine_steps", "Engine steps run over the request slots (--parallel > 1)"),
                 ("batched_steps", "batched_steps", "Engine steps whose decode read several slots' tokens in one "
                                                    "batched step"),
                 ("batched_rows", "batched_rows", "Rows (one slot's token each) of the batched decode steps"),
                 ("picked_rows", "picked_rows", "Rows of the batched decode steps whose greedy pick was taken with the "
                                                "other rows' (one argmax and one copy for them all)"),
                 ("prefill_parts", "prefill_parts", "Prompt parts read in engine steps"))


class _SlotCollector:
    """The request slots (``Metrics.slots``, refreshed by the /metrics route): slots, busy and idle, requests
    processing and deferred (llama-server's names), the engine step's counters."""

    def __init__(self, metrics: Metrics):
        self.metrics = metrics

    def collect(self):
        if self.metrics.slots is None:
            return
        n, busy, waiting, stats = self.metrics.slots
        for name, v, text in (("slots", n, "Request slots (--parallel)"),
                              ("slots_processing", busy, "Request slots running a request"),
                              ("slots_idle", n - busy, "Request slots without a request"),
                              ("requests_processing", busy, "Requests running in a slot"),
                              ("requests_deferred", waiting, "Requests waiting for a slot")):
            g = GaugeMetricFamily(f"strata_{name}", text)
            g.add_metric([], float(v))
            yield g
        for key, name, text in STEP_COUNTERS:
            c = CounterMetricFamily(f"strata_{name}", text)
            c.add_metric([], float(stats.get(key, 0)))
            yield c
        g = GaugeMetricFamily("strata_batched_rows_max", "The most rows one batched decode step read")
        g.add_metric([], float(stats.get("max_rows", 0)))
        yield g
