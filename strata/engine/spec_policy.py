"""How many drafts each speculative verify takes (--spec-adaptive): AdaptiveN, a pure function of what was measured
(the verdicts of earlier verifies and the times of plain steps and verify rounds), with no clock of its own.

The expected tokens per second of n drafts is E(n) / C(n):

* E(n) = 1 + a_1 + a_1 a_2 + ... + a_1 ... a_n tokens a round emits, where a_k is the acceptance at depth k (the
  k-th draft of a round, tried only when the k - 1 before it were kept). Each depth counts its own trials and
  successes, so a draft never tried (after a rejection) is never counted as rejected; the counts fade with the
  tokens emitted since (half-life ``half_life`` tokens), and a depth with few trials leans on the depth before it
  (the first on ``prior``), ``prior_weight`` trials' worth.
* C(0) is a plain decode step, C(n) a whole verify round of n drafts (drafting, the verify, judging and the Commit):
  the median of the last ``window`` times measured of each; the first round of each size is left out (its CUDA graph
  is captured then, and a cold first time would make that size look dear for long), as is the first plain step.
  A size not measured yet is priced by a line through the measured ones (through one: its slope assumed at
  ``slope`` plain steps a draft; none: ``base + slope * n`` plain steps).

While n = 0 wins, a probe (a verify of ``probe_n`` drafts) keeps the acceptance measured: after ``probe_first``
plain steps, the gap doubling after each probe that leaves n = 0 the best, up to ``probe_max``; once drafting pays
again the gap starts over at ``probe_first``. While drafting pays, a size beside the best one that has no warm time
yet is tried, so that the best is chosen among times, not a line's guesses. The first steps are plain ones, until
a warm plain step is timed (what every choice is priced against).
"""
from __future__ import annotations

from collections import deque
from statistics import median


class AdaptiveN:
    """The number of drafts (0 .. n_max) of the next step: ``choose``; what happened: ``plain_step`` (a plain decode
    step's seconds) and ``verified`` (a verify round: drafts, how many were kept, its times). See the module's
    docstring for the model and the parameters."""

    def __init__(self, n_max: int, prior: float = 0.7, prior_weight: float = 1.0, half_life: float = 128.0,
                 window: int = 9, probe_n: int = 0, probe_first: int = 2, probe_max: int = 64,
                 base: float = 1.2, slope: float = 0.3):
        self.n_max = int(n_max)
        self.prior, self.prior_weight = float(prior), float(prior_weight)
        self.fade = 0.5 ** (1.0 / float(half_life))
        self.window = int(window)
        self.probe_n = min(int(probe_n), self.n_max)     # 0: the best n >= 1 by the estimates as they stand
        self.probe_first, self.probe_max = int(probe_first), max(int(probe_first), int(probe_max))
        self.base, self.slope = float(base), float(slope)
        self.succ = [0.0] * (self.n_max + 1)        # per depth k (1..n_max): drafts kept, faded
        self.trials = [0.0] * (self.n_max + 1)      # per depth k: drafts tried, faded
        self.steps: deque[float] = deque(maxlen=self.window)
        self.rounds: dict[int, deque[float]] = {}
        self._seen: set[int] = set()                 # sizes timed (0: plain steps)
        self._cold: set[int] = set()                 # plain steps while their only time is the first one
        self._plain = 0                              # plain steps since the last verify
        self._gap = self.probe_first                 # plain steps before the next probe
        self._rounds_fit: tuple | None = None        # _measured() until the next round is timed
        self._best: tuple[int, int] | None = None    # (lo, best(lo)) until the next step is handed in

    # ---- what was measured
    def _fade(self, tokens: int) -> None:
        self._best = None
        f = self.fade ** tokens
        self.succ = [s * f for s in self.succ]
        self.trials = [t * f for t in self.trials]

    def _time(self, size: int, seconds: float, into: deque) -> None:
        """A time of `size` (0: a plain step): the first of each size is cold; a plain step's is kept until a warm
        one comes (every choice is priced against it), a round's is dropped."""
        self._best = None
        if size:
            self._rounds_fit = None
        if size in self._cold:
            into.clear()
            self._cold.discard(size)
        elif size not in self._seen:
            self._seen.add(size)
            if size:
                return
            self._cold.add(size)
        into.append(float(seconds))

    def plain_step(self, seconds: float) -> None:
        """A plain decode step took `seconds` (its read and its token sampled) and emitted one token."""
        self._time(0, seconds, self.steps)
        self._plain += 1
        self._fade(1)

    def verified(self, drafted: int, accepted: int, draft_s: float, verify_s: float, round_s: float = 0.0) -> None:
        """A verify round of `drafted` drafts of which the first `accepted` were kept, its drafting, verify and the
        rest of its round (judging, the Commit) in seconds."""
        self._plain = 0
        drafted, accepted = int(drafted), max(0, min(int(accepted), int(drafted)))
        if drafted <= 0:
            return
        self._fade(accepted + 1)
        for k in range(1, min(accepted + 1, drafted) + 1):        # depths tried: the kept ones and the first miss
            if k <= self.n_max:
                self.trials[k] += 1.0
                self.succ[k] += 1.0 if k <= accepted else 0.0
        self._time(drafted, draft_s + verify_s + round_s, self.rounds.setdefault(drafted, deque(maxlen=self.window)))
        self._gap = min(2 * self._gap, self.probe_max) if self.best() == 0 else self.probe_first

    # ---- the model
    def acceptance(self) -> list[float]:
        """The estimated acceptance at depths 1..n_max (index 0 unused)."""
        out = [1.0]
        prev, w = self.prior, self.prior_weight
        for k in range(1, self.n_max + 1):
            prev = (self.succ[k] + w * prev) / (self.trials[k] + w)
            out.append(prev)
        return out

    @property
    def a(self) -> float:
        """The estimated acceptance of a first draft."""
        return self.acceptance()[1] if self.n_max else self.prior

    def expected_all(self) -> list[float]:
        """E(n) for n = 0..n_max: tokens a round with n drafts emits on average."""
        acc, run, out = self.acceptance(), 1.0, [1.0]
        for k in range(1, self.n_max + 1):
            run *= acc[k]
            out.append(out[-1] + run)
        return out

    def expected(self, n: int) -> float:
        """Tokens a round with n drafts emits on average."""
        return self.expected_all()[n]

    @property
    def t_step(self) -> float | None:
        return median(self.steps) if self.steps else None

    def _measured(self) -> tuple[dict[int, float], float | None]:
        """The round sizes timed -> their median times, and the slope of the line through them (None with fewer
        than two), kept until the next round is timed."""
        if self._rounds_fit is None:
            have = {k: median(v) for k, v in self.rounds.items() if v}
            line = None
            if len(have) >= 2:
                mk = sum(have) / len(have)
                mc = sum(have.values()) / len(have)
                line = max(sum((k - mk) * (c - mc) for k, c in have.items()) / sum((k - mk) ** 2 for k in have), 0.0)
            self._rounds_fit = (have, line)
        return self._rounds_fit

    def costs(self) -> list[float]:
        """C(n) for n = 0..n_max, seconds: measured, or priced from the measured sizes and the plain step."""
        step = median(self.steps) if self.steps else 1.0
        have, line = self._measured()
        out = [step]
        for n in range(1, self.n_max + 1):
            c = have.get(n)
            if c is None:
                if not have:
                    c = step * (self.base + self.slope * n)
                else:
                    near = min(have, key=lambda k: (abs(k - n), -k))
                    c = max(have[near] + (n - near) * (self.slope * step if line is None else line), 1e-9)
            out.append(c)
        return out

    def cost(self, n: int) -> float:
        """Seconds of a step with n drafts (see ``costs``)."""
        return self.costs()[n]

    def best(self, lo: int = 0) -> int:
        """The n in lo..n_max maximising expected tokens per second (no probe)."""
        if self._best is not None and self._best[0] == lo:
            return self._best[1]
        e, c = self.expected_all(), self.costs()
        n = max(range(lo, self.n_max + 1), key=lambda n: e[n] / c[n])
        self._best = (lo, n)
        return n

    def choose(self) -> int:
        """The drafts of the next step (0: a plain decode step)."""
        if not self.steps or 0 in self._cold:
            return 0                  # plain steps first, until one is warm: what every choice is priced against
        best = self.best()
        if best == 0:
            if self.n_max > 0 and self._plain + 1 >= self._gap:
                return self.probe_n or self.best(1)
            return 0
        for k in (best + 1, best - 1):    # a size beside the best one not timed yet is tried (priced, not guessed)
            if 1 <= k <= self.n_max and not self.rounds.get(k):
                return k
        return best

    def snapshot(self) -> dict:
        """What the policy believes (JSON-ready, times in ms): acceptance per depth, the best n, the costs."""
        return {"acceptance": [round(x, 4) for x in self.acceptance()[1:]], "best": self.best(),
                "t_step_ms": None if self.t_step is None else self.t_step * 1e3,
                "round_ms": {k: median(v) * 1e3 for k, v in sorted(self.rounds.items()) if v}}
