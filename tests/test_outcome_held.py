"""A held cycle's outcome stays true as its step moves on.

The cycle concludes *held* - every shard at one step, the survivors holding theirs - before the
step is a checkpoint. Its outcome said "no committed checkpoint to resume from" for ever after,
while the same run printed the step durable on disk. Now the outcome (its file, and what
``wait_outcome`` returns) is written again at each stage of the held step: where it is, and
once committed, what a restart resumes from.
"""

from __future__ import annotations

import asyncio
import json
import os

import pytest

from ray_graceful.coordinator.outcomes import OutcomeBoard
from ray_graceful.outcome import TerminationOutcome
from ray_graceful.protocol import Result

pytestmark = pytest.mark.unit


def held(stage: str, **more) -> dict:
    return {"cycle": 2, "step": 9, "stage": stage, "reason": "", "durable_path": None, **more}


def on_disk(report_dir: str) -> dict:
    with open(os.path.join(report_dir, "job", "outcome-cycle-2.json")) as f:
        return json.load(f)


def test_the_outcome_of_a_held_cycle_says_where_its_step_is_at_each_stage(tmp_path):
    report_dir = str(tmp_path)

    async def scenario():
        board = OutcomeBoard(report_dir, "job")
        board.metrics = None  # no Ray here: the metrics are a courtesy
        first = TerminationOutcome(2, "job", Result.HELD, held=held("held"))
        board.publish(first)
        assert "step 9 held by the survivors" in first.summary()
        assert "no committed checkpoint" not in first.summary()
        assert on_disk(report_dir)["resume_from"] is None

        board.held(2, held("in-keepers"))
        now = await board.wait(2, 1.0)
        assert now.resume_from == {"step": 9, "tier": "memory"}
        assert on_disk(report_dir)["resume_from"] == {"step": 9, "tier": "memory"}
        assert "resume from step 9 (memory)" in now.summary()

        path = "/ckpt/step-00000009"
        board.held(2, held("on-disk", durable_path=path))
        assert on_disk(report_dir)["resume_from"] == {"step": 9, "path": path}
        assert on_disk(report_dir)["held"]["stage"] == "on-disk"
        assert (await board.wait(2, 1.0)).summary().endswith(f"resume from step 9 ({path})")

    asyncio.run(scenario())


def test_a_lost_held_step_says_so_and_names_nothing_to_resume_from(tmp_path):
    board = OutcomeBoard(str(tmp_path), "job")
    board.metrics = None
    board.publish(TerminationOutcome(2, "job", Result.HELD, held=held("held")))
    board.held(2, held("lost", reason="the copies of g/1 did not land by the deadline"))
    outcome = TerminationOutcome.from_dict(on_disk(str(tmp_path)))
    assert outcome.resume_from is None
    assert "held step 9 lost: the copies of g/1 did not land" in outcome.summary()


def test_only_a_held_outcome_is_written_again(tmp_path):
    board = OutcomeBoard(str(tmp_path), "job")
    board.metrics = None
    board.publish(TerminationOutcome(2, "job", Result.COMMITTED, resume_from={"step": 8}))
    board.held(2, held("on-disk", durable_path="/elsewhere"))
    assert on_disk(str(tmp_path))["resume_from"] == {"step": 8}
