"""A request that makes a step fail fails alone: the others in its batch get exactly the tokens
they get without it, and every KV block comes back."""

import pytest

from dspark import LLM, SamplingParams
from tiny import save_random_drafter, save_tiny

VOCAB = 64
POISON = 61          # a prompt token the injected forward fault trips on


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("target")
    save_tiny(str(path), "qwen3", tied=True, vocab=VOCAB, num_hidden_layers=4, seed=4)
    return str(path)


@pytest.fixture(scope="module")
def drafter_dir(tmp_path_factory, target_dir):
    path = tmp_path_factory.mktemp("drafter")
    save_random_drafter(str(path), target_dir, gamma=4, copy_prev=4.0)
    return str(path)


def make_llm(target_dir, drafter_dir=None):
    per_token = 2 * (4 + 1) * 2 * 16 * 4
    return LLM(target_dir, dtype="float32", drafter=drafter_dir, block_size=4,
               kv_cache_bytes=4096 * per_token, max_model_len=128, graph="eager")


def workload():
    prompts = [[5 + i, 9, 13 + 2 * i, 7] for i in range(5)]
    params = [SamplingParams(temperature=0, max_tokens=12, ignore_eos=True) if i % 2 == 0 else
              SamplingParams(temperature=0.9, top_p=0.9, seed=100 + i, max_tokens=12, ignore_eos=True)
              for i in range(5)]
    return prompts, params


def poisoned_params() -> SamplingParams:
    """Valid when made, broken afterwards: building the step's sampling tensors raises."""
    params = SamplingParams(temperature=0.7, max_tokens=12)
    params.min_p = "0.1"
    return params


def fail_on_token(llm: LLM, token: int) -> list[int]:
    """A fault inside the forward whenever a step's inputs hold `token`; returns a call count."""
    worker, calls = llm.engine.worker, [0]
    forward = worker.forward

    def faulty(inputs, *args, **kwargs):
        calls[0] += 1
        if bool((inputs.input_ids == token).any()):
            raise RuntimeError("injected fault")
        return forward(inputs, *args, **kwargs)
    worker.forward = faulty
    return calls


def isolation_rounds(caplog) -> int:
    """Failed steps retried one request at a time (each says so once)."""
    return sum("running them one at a time" in r.getMessage() for r in caplog.records)


def solo_outputs(llm, prompts, params):
    return [llm.generate([p], sp)[0].token_ids for p, sp in zip(prompts, params)]


@pytest.mark.parametrize("speculative", [False, True])
@pytest.mark.parametrize("fault", ["sampling tensors", "forward"])
def test_poisoned_request_fails_alone(target_dir, drafter_dir, speculative, fault, caplog):
    llm = make_llm(target_dir, drafter_dir if speculative else None)
    prompts, params = workload()
    alone = solo_outputs(llm, prompts, params)
    if fault == "forward":
        fail_on_token(llm, POISON)
        bad_prompt, bad_params = [3, POISON, 8], SamplingParams(temperature=0, max_tokens=12)
    else:
        bad_prompt, bad_params = [3, 4, 8], poisoned_params()
    mixed_prompts = prompts[:2] + [bad_prompt] + prompts[2:]
    outs = llm.generate(mixed_prompts, params[:2] + [bad_params] + params[2:])
    bad = outs.pop(2)
    assert bad.finished and bad.finish_reason == "error"
    assert "failed while running this request" in bad.error
    assert [o.token_ids for o in outs] == alone
    assert all(o.finish_reason == "length" and o.error is None for o in outs)
    engine = llm.engine
    assert isolation_rounds(caplog) == 1
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
    assert not engine.requests


def test_poison_mid_generation_keeps_earlier_tokens_of_others(target_dir):
    """The fault strikes later: a request whose own output reaches the poison token."""
    llm = make_llm(target_dir)
    prompts, params = workload()
    alone = solo_outputs(llm, prompts, params)
    victim = alone[0][5]                       # request 0 produces this token at step 6
    calls = fail_on_token(llm, victim)
    outs = llm.generate(prompts, params)
    assert calls[0] > 0
    failed = [i for i, o in enumerate(outs) if o.finish_reason == "error"]
    assert 0 in failed
    for i, o in enumerate(outs):
        if i not in failed:
            assert o.token_ids == alone[i]
    assert llm.engine.block_manager.num_free_blocks == llm.engine.block_manager.num_blocks


def test_a_fault_of_the_batch_as_a_whole_does_not_loop(target_dir, caplog):
    """No request fails alone: after one isolation round the next failed step fails them all."""
    llm = make_llm(target_dir)
    worker = llm.engine.worker
    forward = worker.forward

    def fails_when_shared(inputs, *args, **kwargs):
        if inputs.attn.num_reqs > 1:
            raise RuntimeError("batch fault")
        return forward(inputs, *args, **kwargs)
    worker.forward = fails_when_shared
    prompts, params = workload()
    outs = llm.generate(prompts[:3], params[:3])
    assert all(o.finish_reason == "error" and "batch fault" in o.error for o in outs)
    assert isolation_rounds(caplog) == 1
    assert llm.engine.block_manager.num_free_blocks == llm.engine.block_manager.num_blocks
    again = llm.generate([prompts[0]], params[0])[0]    # a request alone still runs
    assert again.finish_reason == "length"
