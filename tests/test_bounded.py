"""bounded: every wait has a bound, and a remote call without an answer says why, never raises."""

from __future__ import annotations

import time

import pytest

from ray_graceful.bounded import NoAnswer, Why, call, wait_until


def test_wait_until_returns_the_checks_first_true_value():
    looks = iter([None, 0, "", "there"])
    assert wait_until(lambda: next(looks), timeout=5.0, every=0.001) == "there"


def test_wait_until_gives_up_at_its_timeout_and_looks_a_last_time():
    looks: list[float] = []
    started = time.monotonic()
    assert wait_until(lambda: looks.append(time.monotonic()), timeout=0.05, every=0.01) is None
    assert looks[-1] - started >= 0.05, "the last look is at the deadline, not before it"
    assert len(looks) >= 3


def test_wait_until_with_no_time_left_looks_once():
    looks: list[int] = []
    assert wait_until(lambda: looks.append(1), timeout=-1.0, every=1.0) is None
    assert looks == [1]


class _Answers:
    def value(self, x):
        return x

    def slow(self, seconds):
        time.sleep(seconds)
        return "late"

    def broken(self):
        raise KeyError("no such shard")


@pytest.fixture
def answers(ray_cluster):
    import ray

    actor = ray.remote(num_cpus=0)(_Answers).remote()
    assert ray.get(actor.value.remote(1), timeout=60) == 1
    yield actor
    ray.kill(actor)


def test_call_gives_the_answer(answers):
    assert call(answers.value, {"step": 7}, timeout=10) == {"step": 7}


def test_call_without_an_answer_in_time_is_a_timeout(answers):
    failed = call(answers.slow, 5.0, timeout=0.2)
    assert isinstance(failed, NoAnswer) and failed.why is Why.TIMEOUT
    assert "GetTimeoutError" in str(failed)


def test_call_whose_method_raises_is_failed_with_its_error(answers):
    failed = call(answers.broken, timeout=10)
    assert isinstance(failed, NoAnswer) and failed.why is Why.FAILED
    assert "no such shard" in failed.error


def test_call_to_a_dead_actor_is_dead(answers):
    import ray

    ray.kill(answers, no_restart=True)

    def failed_call() -> NoAnswer | None:  # the kill lands a moment later
        answer = call(answers.value, 1, timeout=5)
        return answer if isinstance(answer, NoAnswer) else None

    failed = wait_until(failed_call, timeout=30, every=0.1)
    assert isinstance(failed, NoAnswer) and failed.why is Why.DEAD, failed
