"""The speculation policy sees the running requests before prefill is admitted, so the step
tokens it takes back from undrafted speculative blocks go to waiting requests' prefill."""

from dspark.config import SchedulerConfig
from dspark.engine.block_manager import BlockManager
from dspark.engine.scheduler import Scheduler
from dspark.engine.sequence import Sequence, SequenceStatus
from dspark.sampling_params import SamplingParams
from dspark.spec.planner import StepPlan


class Recording:
    """Stands in for the policy: records what it is asked, leaves every request undrafted
    (`undraft`) or drafted."""

    def __init__(self, undraft: bool):
        self.undraft, self.seen = undraft, []

    def plan(self, candidates, step):
        self.seen.append(([(c.request_id, c.verify_cap) for c in candidates], step.joining_tokens))
        return StepPlan(drafted=[not self.undraft] * len(candidates), budget=0,
                        full=GAMMA * len(candidates))

    def forget(self, request_id):
        pass

GAMMA, BUDGET = 4, 16


def decoding(request_id: str) -> Sequence:
    """A running request with one output token: its next step is a speculative block."""
    seq = Sequence(request_id, [1, 2, 3], SamplingParams(max_tokens=32))
    seq.output_token_ids.append(4)
    seq.num_computed_tokens = 3
    return seq


def scheduler_with(running: list[Sequence], waiting: Sequence) -> Scheduler:
    blocks = BlockManager(num_blocks=64, block_size=4)
    sched = Scheduler(SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=BUDGET), blocks,
                      max_model_len=256, num_spec_tokens=GAMMA)
    for seq in running:
        blocks.ensure(seq.block_table, seq.num_computed_tokens)
        seq.status = SequenceStatus.RUNNING
        sched.running.append(seq)
    sched.add(waiting)
    return sched


def test_undrafted_blocks_give_their_tokens_to_prefill():
    prompt = list(range(100))
    for undraft, prefill in ((False, BUDGET - 2 * (1 + GAMMA)), (True, BUDGET - 2)):
        running = [decoding("a"), decoding("b")]
        sched = scheduler_with(running, Sequence("new", prompt, SamplingParams()))
        sched.policy = Recording(undraft)
        out = sched.schedule()
        chunks = {s.seq.request_id: s.num_new_tokens for s in out.scheduled}
        assert chunks["new"] == prefill and sum(chunks.values()) == BUDGET
        # the policy saw only the running blocks, at their full reservation, and the prefill
        # that would join the step were nothing drafted
        assert sched.policy.seen == [([("a", GAMMA), ("b", GAMMA)], BUDGET - 2)]
        assert out.plan.drafted == [not undraft] * 2
        if undraft:
            assert chunks["a"] == chunks["b"] == 1
            assert running[0].spec.undrafted_steps == 1


def test_the_joining_prefill_counts_free_slots_and_the_budget_left():
    """Waiting requests join while sequence slots and step tokens last."""
    def joining(max_num_seqs: int, step_tokens: int) -> int:
        sched = scheduler_with([decoding("a"), decoding("b")], Sequence("short", [5, 6, 7], SamplingParams()))
        sched.add(Sequence("long", list(range(40)), SamplingParams()))
        sched.add(Sequence("third", [8, 9], SamplingParams()))
        sched.config.max_num_seqs, sched.config.max_num_batched_tokens = max_num_seqs, step_tokens
        sched.policy = Recording(undraft=False)
        sched.schedule()
        return sched.policy.seen[0][1]
    assert joining(4, BUDGET) == BUDGET - 2             # two free slots, the budget left binds
    assert joining(4, 64) == 3 + 40                     # two free slots: "third" cannot join
    assert joining(8, 64) == 3 + 40 + 2
    assert joining(2, 64) == 0                          # no free slot
