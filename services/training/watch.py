"""The reward-hacking watch: a policy that learns to please the training reward instead of doing
the task shows it as a held-out reward that falls while the train reward rises. After each
held-out evaluation the watch looks two ways, each needing both rewards to move by at least
`min_change` (in reward units):

    the trend   the last `window` evaluations: the least-squares trend of the held-out reward
                across them against that of the train reward (the mean train reward of the
                iterations since the evaluation before)
    the start   once `window` - 1 evaluations have followed the one it started from (the
                baseline before any training, else its first): the held-out reward now below
                the start's, the train reward (this interval's mean) above the first interval's.
                A run that falls in its first iterations (before the window fills) is seen here
    the best    as the start, from the best evaluation since the start instead: the held-out
                reward now below the best's, the train reward above that evaluation's interval
                (a run that climbed, then fell while its reward rose: the fall from its best that
                a target such as "never more than 0.05 below its best" counts)

The watch is for one training reward: given `reward` (an identity of it: `reward_identity`), a
checkpoint of another reward's watch is not restored (a reward model refreshed between rounds
scores on another scale), and the watch starts again from the next evaluation.
Pure logic: the learner and the in-process trainer feed it and report what it says (log, status,
metrics).

    watch = HackingWatch(window=3, min_change=0.05)
    watch.train(0.41)                       # every iteration: its mean train reward
    verdict = watch.evaluated(10, 0.93)     # every evaluation: iteration, held-out reward
    if verdict.onset:
        log.warning(verdict.message())
    verdict, row = judge(watch, 10, {"eval/reward_mean": 0.93}, log.warning)   # the same, and the
                                                                              # metrics row's entry
"""

from __future__ import annotations

import hashlib
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
    eval_change: float = 0.0  # trend of the held-out reward across them (since the start: its change)
    train_change: float = 0.0  # trend of the train reward across them (since the start: its change)
    since_start: bool = False  # seen from the start, not the trend: `iterations` are the start's and now
    since_best: bool = False  # seen from the best evaluation: `iterations` are the best's and now

    def message(self) -> str:
        its = self.iterations
        if self.since_best:
            across = f"since its best evaluation, at iteration {its[0]} (to iteration {its[-1]})"
        elif self.since_start:
            across = f"since the evaluation of iteration {its[0]} (to iteration {its[-1]})"
        else:
            across = f"across the evaluations of iterations {its[0]}..{its[-1]} ({len(its)} evaluations)"
        return (
            f"reward hacking suspected: {across} the held-out reward fell by {-self.eval_change:.3f} while the "
            f"train reward rose by {self.train_change:.3f}: the policy may be exploiting the training reward"
        )

    def as_status(self) -> dict:
        return {
            "suspected": self.suspected,
            "iterations": list(self.iterations),
            "eval_change": round(self.eval_change, 6),
            "train_change": round(self.train_change, 6),
            "since_start": self.since_start,
            "since_best": self.since_best,
        }


# the reward section's settings of how its scores are fetched (the HTTP API's transport, retries),
# not of what they are: changing them leaves the reward the watch compares the same
DELIVERY = frozenset(
    {
        "http_timeout_s",
        "http_retries",
        "http_backoff_s",
        "http_max_backoff_s",
        "http_retry_after_max_s",
        "http_concurrency",
        "http_auth_env",
        "http_auth_header",
        "http_auth_scheme",
        "http_breaker_failures",
        "http_breaker_cooldown_s",
        "group_retries",
        "group_retry_wait_s",
    }
)


def reward_identity(reward_section) -> str:
    """What names a training reward for the watch: its config section (rules, reward model, API,
    weights, penalties) without the settings of how its scores are fetched (`DELIVERY`)."""
    what = reward_section.model_dump_json(exclude=set(DELIVERY))
    return hashlib.sha256(what.encode()).hexdigest()[:16]


class HackingWatch:
    def __init__(self, window: int = 3, min_change: float = 0.05, reward: str | None = None):
        """`window` evaluations compared (0 = off); `min_change`: the least fall of the held-out
        reward and the least rise of the train reward that count; `reward`: the training reward's
        identity (a checkpoint of another's watch is not restored)."""
        self.window, self.min_change, self.reward = window, min_change, reward
        self.points: list[tuple[int, float, float]] = []  # (iteration, held-out reward, train reward)
        self._train: list[float] = []  # train rewards since the last evaluation
        self.last = Verdict()
        self.since: int | None = None  # the iteration at which the current suspicion began
        self.start: tuple[int, float] | None = None  # (iteration, held-out reward) it started from
        self.start_train: float | None = None  # the first interval's mean train reward
        self.after_start = 0  # evaluations with training since the start
        self.best: tuple[int, float, float] | None = None  # the best point since the start

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
        if self.enabled and self.start is None:
            self.start = (iteration, float(eval_reward))  # the baseline, else the first point
        if not self.enabled or not self._train or self.start is None:
            return replace(self.last, onset=False)  # nothing new: no second warning for one onset
        train = sum(self._train) / len(self._train)
        self.points.append((iteration, float(eval_reward), train))
        self.points = self.points[-self.window :]
        self._train = []
        if self.start_train is None:
            self.start_train = train
        if self.start[0] != iteration:
            self.after_start += 1
        was = self.last.suspected
        verdict = (
            self._trend()
            or self._from_start(iteration, float(eval_reward), train)
            or self._from_best(iteration, float(eval_reward), train)
            or Verdict()
        )
        if self.best is None or eval_reward > self.best[1]:
            self.best = (iteration, float(eval_reward), train)
        self.last = replace(verdict, onset=verdict.suspected and not was)
        if self.last.onset:
            self.since = iteration
        elif not self.last.suspected:
            self.since = None
        return self.last

    def _counts(self, eval_change: float, train_change: float) -> bool:
        return -eval_change >= self.min_change and train_change >= self.min_change and eval_change < 0 < train_change

    def _trend(self) -> Verdict | None:
        if len(self.points) < self.window:
            return None
        eval_change = trend([p[1] for p in self.points])
        train_change = trend([p[2] for p in self.points])
        if not self._counts(eval_change, train_change):
            return None
        return Verdict(True, False, [p[0] for p in self.points], eval_change, train_change)

    def _from_start(self, iteration: int, eval_reward: float, train: float) -> Verdict | None:
        assert self.start is not None and self.start_train is not None  # set by evaluated()
        if self.after_start < self.window - 1:
            return None
        eval_change, train_change = eval_reward - self.start[1], train - self.start_train
        if not self._counts(eval_change, train_change):
            return None
        return Verdict(True, False, [self.start[0], iteration], eval_change, train_change, since_start=True)

    def _from_best(self, iteration: int, eval_reward: float, train: float) -> Verdict | None:
        if self.best is None or self.after_start < self.window - 1:  # as from the start: a window's evidence
            return None
        eval_change, train_change = eval_reward - self.best[1], train - self.best[2]
        if not self._counts(eval_change, train_change):
            return None
        return Verdict(True, False, [self.best[0], iteration], eval_change, train_change, since_best=True)

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
            "start": list(self.start) if self.start is not None else None,
            "start_train": self.start_train,
            "after_start": self.after_start,
            "best": list(self.best) if self.best is not None else None,
            "reward": self.reward,
        }

    def load_state_dict(self, state: dict) -> bool:
        """Restore what `state_dict` saved (a resumed learner goes on with the same window).
        False, restoring nothing, when it watched another training reward than this one's."""
        if self.reward is not None and state.get("reward") not in (None, self.reward):
            return False
        start = state.get("start")
        self.start = (int(start[0]), float(start[1])) if start else None
        self.start_train = state.get("start_train")
        self.after_start = int(state.get("after_start", 0))
        best = state.get("best")
        self.best = (int(best[0]), float(best[1]), float(best[2])) if best else None
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
            bool(last.get("since_start", False)),
            bool(last.get("since_best", False)),
        )
        return True


def judge(watch: HackingWatch, iteration: int, evaluated: dict, warn) -> tuple[Verdict, dict]:
    """Feed an evaluation's metrics (`eval/reward_mean`) to `watch`, calling `warn(message)` at
    an onset. Returns the verdict and what it adds to the metrics row: `eval/hacking_suspected`
    (0 or 1) when the watch is on."""
    verdict = watch.evaluated(iteration, evaluated["eval/reward_mean"])
    if verdict.onset:
        warn(verdict.message())
    return verdict, ({"eval/hacking_suspected": int(verdict.suspected)} if watch.enabled else {})


def restore_watch(watch: HackingWatch, state: dict, warn) -> None:
    """A checkpoint's watch restored into `watch`, or, when it watched another training reward
    (a reward model refreshed since), `warn` that it starts again."""
    if not watch.load_state_dict(state):
        warn(
            "the reward-hacking watch starts again: the checkpoint's watched another training reward "
            "(reward section changed); its next evaluation is its start"
        )
