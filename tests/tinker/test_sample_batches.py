"""The Tinker API's sample batching (services/tinker/sampling.py `SampleBatches`): jobs queued
before the compute thread comes to them decode together when they name the same weights and
sampling parameters, at most `max_sequences` sequences a batch; a seeded job alone; a failed batch
answers each of its jobs with the failure; a job that arrives while a drain runs gets a drain of
its own."""

from __future__ import annotations

from services.common.types import SamplingParams
from services.tinker.sampling import SampleBatches, SampleJob, SampleSpec


class Thread:
    """The compute thread, by hand: queued work runs when `step` says."""

    def __init__(self):
        self.queued = []

    def submit(self, fn):
        self.queued.append(fn)

    def step(self):
        fn = self.queued.pop(0)
        fn()


def _job(answers, name, key="base", n=2, seed=None, temperature=1.0):
    spec = SampleSpec([1, 2, 3], SamplingParams(n=n, temperature=temperature, max_new_tokens=4, seed=seed))
    return SampleJob(key, None, spec, lambda result: answers.append((name, result)))


def test_jobs_queued_together_decode_together_by_weights_and_parameters():
    thread, calls, answers = Thread(), [], []

    def run(key, load, specs):
        calls.append((key, len(specs)))
        return [f"{key}:{i}" for i in range(len(specs))]

    batches = SampleBatches(thread.submit, run, max_sequences=6)
    for job in [
        _job(answers, "a"),
        _job(answers, "b", key="ckpt"),
        _job(answers, "c"),
        _job(answers, "d", seed=7),
        _job(answers, "e"),
        _job(answers, "f", temperature=0.0),
        _job(answers, "g"),  # the fourth of 2 samples on the base: past 6 sequences, a batch of its own
    ]:
        batches.add(job)
    assert len(thread.queued) == 1  # one drain for all of them
    thread.step()
    assert calls == [("base", 3), ("base", 1), ("ckpt", 1), ("base", 1), ("base", 1)]
    assert sorted(name for name, _ in answers) == list("abcdefg")
    assert dict(answers)["c"] == "base:1" and dict(answers)["g"] == "base:0"


def test_a_failed_batch_answers_each_job_and_a_late_job_gets_its_own_drain():
    thread, answers = Thread(), []
    boom = RuntimeError("weights gone")

    def run(key, load, specs):
        if key == "gone":
            raise boom
        batches.add(_job(answers, "late"))  # arrives while the drain runs
        return ["ok"] * len(specs)

    batches = SampleBatches(thread.submit, run, max_sequences=64)
    batches.add(_job(answers, "x", key="gone"))
    batches.add(_job(answers, "y", key="gone"))
    batches.add(_job(answers, "z"))
    thread.step()
    assert answers[:3] == [("x", boom), ("y", boom), ("z", "ok")]
    assert len(thread.queued) == 1  # the late job's drain
    thread.step()
    assert answers[3] == ("late", "ok")
