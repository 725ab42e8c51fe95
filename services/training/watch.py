"""The reward-hacking watch: a policy that learns to please the training reward instead of doing
the task shows it as a held-out reward that falls while the train reward rises. After each
held-out evaluation the watch compares the last `window` evaluations: the least-squares trend of
the held-out reward across them against that of the train reward (the mean train reward of the
iterations since the evaluation before). Both must move by at least `min_change` (in reward
units, across the window) for the watch to fire. Pure logic: the learner and the in-process
trainer feed it and report what it says (log, status, metrics).

    watch = HackingWatch(window=3, min_change=0.05)
    watch.train(0.41)                       # every iteration: its mean train reward
    verdict = watch.evaluated(10, 0.93)     # every evaluation: iteration, held-out reward
    if verdict.onset:
        log.warning(verdict.message())
    verdict, row = judge(watch, 10, {"eval/reward_mean": 0.93}, log.warning)   # the same, and the
                                                                              # metrics row's entry
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace


def trend(values: list[float]) -> float:
    """The change across `values` along their least-squares line (slope x (n - 1)): how far a
    series moved from its first point to its last, with the noise in between averaged out."""
    n = len(values)
    if n < 2:
        return 0.0
    mean_x, mean_y = (n - 1) / 2, sum(values) / n
    sxx = sum((i - mean_x) ** 2 for i in range(n))
    sxy = sum((i - mean_x) * (v - mean_y) for i, v in enumerate(values))
    return sxy / sxx * (n - 1)


@dataclass
class Verdict:
    """What the watch says after one evaluation."""

    suspected: bool = False
    onset: bool = False  # suspected now and not after the evaluation before
    iterations: list[int] = field(default_factory=list)  # the evaluations compared
    eval_change: float = 0.0  # trend of the held-out reward across them
    train_change: float = 0.0  # trend of the train reward across them

    def message(self) -> str:
        its = self.iterations
        return (
            f"reward hacking suspected: across the evaluations of iterations {its[0]}..{its[-1]} "
            f"({len(its)} evaluations) the held-out reward fell by {-self.eval_change:.3f} while the train "
            f"reward rose by {self.train_change:.3f}: the policy may be exploiting the training reward"
        )

    def as_status(self) -> dict:
        return {
            "suspected": self.suspected,
            "iterations": list(self.iterations),
            "eval_change": round(self.eval_change, 6),
            "train_change": round(self.train_change, 6),
        }


class HackingWatch:
    def __init__(self, window: int = 3, min_change: float = 0.05):
        """`window` evaluations compared (0 = off); `min_change`: the least fall of the held-out
        reward and the least rise of the train reward that count."""
        self.window, self.min_change = window, min_change
        self.points: list[tuple[int, float, float]] = []  # (iteration, held-out reward, train reward)
        self._train: list[float] = []  # train rewards since the last evaluation
        self.last = Verdict()
        self.since: int | None = None  # the iteration at which the current suspicion began

    @property
    def enabled(self) -> bool:
        return self.window >= 2

    def train(self, reward: float) -> None:
        """One training iteration's mean train reward (non-finite values are ignored)."""
        if reward == reward and abs(reward) != float("inf"):
            self._train.append(float(reward))

    def evaluated(self, iteration: int, eval_reward: float) -> Verdict:
        """A held-out evaluation at `iteration`. An evaluation with no training since the one
        before (the baseline) has no train reward to compare with and is not a point."""
        if not self.enabled or not self._train:
            return replace(self.last, onset=False)  # nothing new: no second warning for one onset
        self.points.append((iteration, float(eval_reward), sum(self._train) / len(self._train)))
        self.points = self.points[-self.window :]
        self._train = []
        was = self.last.suspected
        if len(self.points) < self.window:
            self.last = Verdict()
        else:
            eval_change = trend([p[1] for p in self.points])
            train_change = trend([p[2] for p in self.points])
            fell, rose = -eval_change, train_change
            suspected = fell > 0 and rose > 0 and fell >= self.min_change and rose >= self.min_change
            self.last = Verdict(
                suspected, suspected and not was, [p[0] for p in self.points], eval_change, train_change
            )
        if self.last.onset:
            self.since = iteration
        elif not self.last.suspected:
            self.since = None
        return self.last

    def status(self) -> dict | None:
        """For the learner's /status: None while nothing is suspected, else what and since when."""
        if not self.last.suspected:
            return None
        return {**self.last.as_status(), "since_iteration": self.since}

    def state_dict(self) -> dict:
        return {
            "points": [list(p) for p in self.points],
            "train": list(self._train),
            "since": self.since,
            "last": self.last.as_status(),
        }

    def load_state_dict(self, state: dict) -> None:
        """Restore what `state_dict` saved (a resumed learner goes on with the same window)."""
        self.points = [(int(i), float(e), float(t)) for i, e, t in state.get("points", [])]
        self.points = self.points[-self.window :] if self.enabled else []
        self._train = [float(v) for v in state.get("train", [])]
        self.since = state.get("since")
        last = state.get("last") or {}
        self.last = Verdict(
            bool(last.get("suspected", False)),
            False,
            list(last.get("iterations", [])),
            float(last.get("eval_change", 0.0)),
            float(last.get("train_change", 0.0)),
        )


def judge(watch: HackingWatch, iteration: int, evaluated: dict, warn) -> tuple[Verdict, dict]:
    """Feed an evaluation's metrics (`eval/reward_mean`) to `watch`, calling `warn(message)` at
    an onset. Returns the verdict and what it adds to the metrics row: `eval/hacking_suspected`
    (0 or 1) when the watch is on."""
    verdict = watch.evaluated(iteration, evaluated["eval/reward_mean"])
    if verdict.onset:
        warn(verdict.message())
    return verdict, ({"eval/hacking_suspected": int(verdict.suspected)} if watch.enabled else {})
