"""A sampled round, batched, against a position-by-position reference: the Markov loop draws
every position's noise up front and the acceptance tests every position in one pass, yet for the
same seeds (and the same global seed, for unseeded rows) drafts, q, accepted counts and tokens
are bit for bit the reference's, and every generator continues where the reference left it."""

import pytest
import torch

from dspark.models.drafter_loader import load_drafter
from dspark.models.loader import load_target
from dspark.sampling_params import SamplingParams
from dspark.spec.draft import _markov_loop
from dspark.spec.sampler import SamplingTensors, processed_probs
from dspark.spec.types import DraftProposal
from dspark.spec.verify import _target_probs, accept
from dspark.train.prune_vocab import prune_drafter
from tiny import save_random_drafter, save_tiny

VOCAB = 48
ROWS = {   # (temperature, seed) per row: greedy, seeded and unseeded rows, mixed and alone
    "mixed": [(0.7, 1), (0.0, 3), (1.3, None), (0.2, 4), (0.0, None), (0.9, None)],
    "seeded": [(0.2, 11), (1.0, 12)],
    "unseeded": [(0.2, None), (0.6, None), (1.1, None)],
}


def tensors(rows, vocab, **kw) -> SamplingTensors:
    params = [SamplingParams(temperature=t, seed=s, **kw) for t, s in rows]
    gens = [None if p.seed is None else torch.Generator().manual_seed(p.seed) for p in params]
    return SamplingTensors.build(params, gens, vocab, torch.device("cpu"))


def continuations(st: SamplingTensors) -> list:
    """The next draws of every generator, the global one last: equal iff the streams are."""
    own = [torch.rand(3, generator=g).tolist() for g in st.generators if g is not None]
    return own + [torch.rand(3).tolist()]


@pytest.fixture(scope="module", params=["vanilla", "gated", "rnn"])
def drafters(request, tmp_path_factory):
    target_dir = str(tmp_path_factory.mktemp("target"))
    save_tiny(target_dir, "llama", tied=True, vocab=VOCAB, num_hidden_layers=4, seed=4)
    drafter_dir = str(tmp_path_factory.mktemp("drafter"))
    save_random_drafter(drafter_dir, target_dir, gamma=5, rank=8, std=0.3, markov_type=request.param,
                        sample_from_anchor=request.param != "rnn")
    target = load_target(target_dir, torch.float32)
    full = load_drafter(drafter_dir, target.config, target.model.embed_tokens, target.model.lm_head,
                        torch.float32)
    return {"full": full, "draft": prune_drafter(full, torch.arange(1, VOCAB, 3))}


def reference_drafts(drafter, h, base, anchors, state, st):
    """Position by position: q = softmax(scatter(logits) / T) over the target vocabulary; a
    seeded row draws one Exp(1) vector of V per position from its generator and races over V;
    unseeded rows draw the block's noise over the draft vocabulary together, before the loop."""
    cfg, r, gamma = drafter.config, h.shape[0], h.shape[1]
    free = [i for i in range(r) if st.generators[i] is None and not st.greedy_host[i]]
    free_noise = torch.empty(len(free), gamma, cfg.draft_vocab_size).exponential_() if free else None
    tokens, probs, conf, prev = [], [], [], anchors
    for k in range(gamma):
        e = drafter.markov_embed(prev)
        bias, state = drafter.markov_bias(e, h[:, k], state)
        logits = base[:, k] + bias
        conf.append(drafter.confidence_logits(h[:, k], e).float())
        q = torch.softmax(drafter.scatter_to_target_vocab(logits) / st.temperature[:, None], dim=-1)
        picked = []
        for i in range(r):
            if st.greedy_host[i]:
                picked.append(drafter.to_target_ids(logits[i].argmax()))
            elif st.generators[i] is not None:
                noise = torch.empty(cfg.vocab_size).exponential_(generator=st.generators[i])
                picked.append((q[i] / noise).argmax())
            else:
                q_draft = q[i] if not cfg.uses_draft_vocab else q[i, drafter.draft_to_target_index]
                picked.append(drafter.to_target_ids((q_draft / free_noise[free.index(i), k]).argmax()))
        prev = torch.stack(picked)
        tokens.append(prev)
        probs.append(q)
    return torch.stack(tokens, 1), torch.stack(probs, 1), torch.stack(conf, 1)


@pytest.mark.parametrize("vocab", ["full", "draft"])
@pytest.mark.parametrize("rows", list(ROWS))
@pytest.mark.parametrize("seed", [0, 1])
def test_markov_loop_matches_the_position_by_position_reference(drafters, vocab, rows, seed):
    drafter = drafters[vocab]
    cfg, r = drafter.config, len(ROWS[rows])
    torch.manual_seed(seed)
    h = torch.randn(r, cfg.block_size, cfg.hidden_size)
    base = drafter.base_logits(h)
    anchors = torch.randint(3, VOCAB - 1, (r,))
    state = drafter.init_markov_state(torch.randn(r, cfg.num_block_slots, cfg.hidden_size), anchors)
    runs = []
    for run in (_markov_loop, reference_drafts):
        st = tensors(ROWS[rows], VOCAB)
        torch.manual_seed(100 + seed)
        with torch.no_grad():
            out = run(drafter, h, base, anchors, state, st)
        out = (out.tokens, out.probs, out.confidence_logits) if run is _markov_loop else out
        runs.append((out, continuations(st)))
    (got, got_next), (want, want_next) = runs
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    assert got_next == want_next
    assert len({tuple(t) for t in got[0].tolist()}) > 1


def reference_accept(logits, lens, drafts, q, st):
    """Row by row, position by position: draft j passes while u_j q_j(x_j) <= p_j(x_j); the row
    after the passed prefix draws from the residual max(p - q, 0) at a rejection (p if it has
    no mass) or from p after the last verified draft. Noise is drawn in the engine's order:
    the uniforms (global for every row, then each seeded row's own), then Exp(1) of V per row."""
    r, g1, v = logits.shape
    p = processed_probs(logits.reshape(r * g1, v), st.repeat(g1)).view(r, g1, v)
    u = torch.rand(r, g1 - 1)
    for i, gen in enumerate(st.generators):
        if gen is not None:
            u[i] = torch.rand(g1 - 1, generator=gen)
    free = [i for i, gen in enumerate(st.generators) if gen is None]
    free_noise = torch.empty(len(free), v).exponential_() if free else None
    accepted, tokens = [], []
    for i in range(r):
        gen = st.generators[i]
        noise = free_noise[free.index(i)] if gen is None else torch.empty(v).exponential_(generator=gen)
        a, target = 0, logits[i].argmax(-1)
        if st.greedy_host[i]:
            while a < lens[i] and drafts[i, a] == target[a]:
                a += 1
            accepted.append(a)
            tokens.append(drafts[i, :a].tolist() + [int(target[a])])
            continue
        while a < lens[i] and u[i, a] * q[i, a, drafts[i, a]] <= p[i, a, drafts[i, a]]:
            a += 1
        dist = p[i, a]
        if a < lens[i]:
            residual = (p[i, a] - q[i, a]).clamp(min=0)
            dist = residual if residual.sum() > 0 else dist
        accepted.append(a)
        tokens.append(drafts[i, :a].tolist() + [int((dist / noise).argmax())])
    return accepted, tokens


SETTINGS = [dict(), dict(top_k=5), dict(top_p=0.8), dict(min_p=0.1), dict(top_k=7, top_p=0.9, min_p=0.05)]


@pytest.mark.parametrize("vocab", [40, 600])          # below and above the truncation's candidates
@pytest.mark.parametrize("settings", SETTINGS)
@pytest.mark.parametrize("rows", list(ROWS))
def test_acceptance_matches_the_position_by_position_reference(vocab, settings, rows):
    r, gamma = len(ROWS[rows]), 5
    for trial in range(3):
        torch.manual_seed(trial)
        logits = torch.randn(r, gamma + 1, vocab) * 3
        q = torch.softmax(torch.randn(r, gamma, vocab) * 3, dim=-1)
        q[:, 1] = torch.softmax(logits[:, 1], dim=-1)          # a position where q equals p
        drafts = torch.multinomial(q.reshape(-1, vocab), 1).view(r, gamma)
        drafts[:, 0] = logits[:, 0].argmax(-1)                 # greedy rows pass a draft or more
        lens = torch.randint(0, gamma + 1, (r,))
        runs = []
        for run in ("batched", "reference"):
            st = tensors(ROWS[rows], vocab, **settings)
            torch.manual_seed(50 + trial)
            if run == "batched":
                res = accept(logits, lens, DraftProposal(drafts, q, None), st)
                a = res.num_accepted.tolist()
                out = (a, [res.tokens[i, :a[i] + 1].tolist() for i in range(r)])
            else:
                out = reference_accept(logits, lens, drafts, q, st)
            runs.append((out, continuations(st)))
        assert runs[0] == runs[1]


@pytest.mark.parametrize("rows", list(ROWS))
def test_temperature_alone_gives_the_bits_of_the_repeated_rows(rows):
    """The acceptance divides each block by its request's temperature in place of repeating the
    parameters per position: the target's p keeps its bits, not only the tokens drawn from it."""
    r, g1, v = len(ROWS[rows]), 6, 600
    st = tensors(ROWS[rows], v)
    logits = torch.randn(r, g1, v) * 3
    want = processed_probs(logits.reshape(r * g1, v), st.repeat(g1)).view(r, g1, v)
    assert torch.equal(_target_probs(logits, st), want)
