"""A sampled round, batched, against a position-by-position reference: the Markov loop draws
every position's noise up front and the acceptance tests every position in one pass, yet for the
same seeds (and the same global seed, for unseeded rows) drafts, q, accepted counts and tokens
are bit for bit the reference's, and the global generator continues where the reference left it.
A seeded row's reference draws each position's noise from a generator seeded by (seed, position)
alone, and accepts a draft when the target's own race on that noise gives it."""

import pytest
import torch

from dspark.models.drafter_loader import load_drafter
from dspark.models.loader import load_target
from dspark.sampling_params import SamplingParams
from dspark.spec.draft import _markov_loop
from dspark.spec.sampler import NoiseKey, SamplingTensors, _mix, processed_logits, processed_probs
from dspark.spec.types import DraftProposal
from dspark.spec.verify import _target_scores, accept
from dspark.train.prune_vocab import prune_drafter
from tiny import save_random_drafter, save_tiny, scatter_to_target_vocab

VOCAB = 48
ROWS = {   # (temperature, seed) per row: greedy, seeded and unseeded rows, mixed and alone
    "mixed": [(0.7, 1), (0.0, 3), (1.3, None), (0.2, 4), (0.0, None), (0.9, None)],
    "seeded": [(0.2, 11), (1.0, 12)],
    "unseeded": [(0.2, None), (0.6, None), (1.1, None)],
}


def tensors(rows, vocab, **kw) -> SamplingTensors:
    params = [SamplingParams(temperature=t, seed=s, **kw) for t, s in rows]
    keys = [None if p.seed is None or p.greedy else NoiseKey(p.seed, 17) for p in params]
    return SamplingTensors.build(params, keys, vocab, torch.device("cpu"))


def position_noise(key: NoiseKey, offset: int, vocab: int) -> torch.Tensor:
    """Exp(1) [V]: what a seeded row's position key.position + offset races on."""
    gen = torch.Generator().manual_seed(_mix(key.seed, key.position + offset))
    return torch.empty(vocab).exponential_(generator=gen)


def continuations(st: SamplingTensors) -> list:
    """The global generator's next draws: equal iff the streams are."""
    return [torch.rand(3).tolist()]


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
    seeded row races over V on its position's noise; unseeded rows draw the block's noise over
    the draft vocabulary together, before the loop. Where every sampled row is seeded, no q: each
    position is the argmax of logits plus T times the Gumbel noise -log E of its position."""
    cfg, r, gamma = drafter.config, h.shape[0], h.shape[1]
    if not st.all_greedy and all(k is not None or g for k, g in zip(st.keys, st.greedy_host)):
        return raced_reference(drafter, h, base, anchors, state, st)
    free = [i for i in range(r) if st.keys[i] is None and not st.greedy_host[i]]
    free_noise = torch.empty(len(free), gamma, cfg.draft_vocab_size).exponential_() if free else None
    tokens, probs, conf, prev = [], [], [], anchors
    for k in range(gamma):
        e = drafter.markov_embed(prev)
        bias, state = drafter.markov_bias(e, h[:, k], state)
        logits = base[:, k] + bias
        conf.append(drafter.confidence_logits(h[:, k], e).float())
        q = torch.softmax(scatter_to_target_vocab(drafter, logits) / st.temperature[:, None], dim=-1)
        picked = []
        for i in range(r):
            if st.greedy_host[i]:
                picked.append(drafter.to_target_ids(logits[i].argmax()))
            elif st.keys[i] is not None:
                picked.append((q[i] / position_noise(st.keys[i], k, cfg.vocab_size)).argmax())
            else:
                q_draft = q[i] if not cfg.uses_draft_vocab else q[i, drafter.draft_to_target_index]
                picked.append(drafter.to_target_ids((q_draft / free_noise[free.index(i), k]).argmax()))
        prev = torch.stack(picked)
        tokens.append(prev)
        probs.append(q)
    return torch.stack(tokens, 1), torch.stack(probs, 1), torch.stack(conf, 1)


def raced_reference(drafter, h, base, anchors, state, st):
    cfg, gamma = drafter.config, h.shape[1]
    columns = drafter.draft_to_target_index if cfg.uses_draft_vocab else torch.arange(cfg.vocab_size)
    noised = base.clone()
    for i, key in enumerate(st.keys):
        if key is not None:
            gumbel = torch.stack([position_noise(key, k, cfg.vocab_size)[columns] for k in range(gamma)]).log().neg()
            noised[i] = base[i] + gumbel * st.temperature[i]
    tokens, conf, prev = [], [], anchors
    for k in range(gamma):
        e = drafter.markov_embed(prev)
        bias, state = drafter.markov_bias(e, h[:, k], state)
        conf.append(drafter.confidence_logits(h[:, k], e).float())
        prev = drafter.to_target_ids((noised[:, k] + bias).argmax(-1))
        tokens.append(prev)
    return torch.stack(tokens, 1), None, torch.stack(conf, 1)


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
    assert all(a is b is None or torch.equal(a, b) for a, b in zip(got, want))
    assert (got[1] is None) == (rows == "seeded")               # q only where a row needs it
    assert got_next == want_next
    assert len({tuple(t) for t in got[0].tolist()}) > 1


def reference_accept(logits, lens, drafts, q, st, raced=False):
    """Row by row, position by position: draft j passes while u_j q_j(x_j) <= p_j(x_j); the row
    after the passed prefix draws from the residual max(p - q, 0) at a rejection (p if it has
    no mass) or from p after the last verified draft. A seeded row passes draft j while it is
    the target's own draw at that position (its race on the position's noise) and then takes
    that draw. Global noise in the engine's order: the uniforms, then Exp(1) of V per row (none
    when the drafts came without q: every sampled row seeded)."""
    r, g1, v = logits.shape
    scores = processed_logits(logits.reshape(r * g1, v), st.repeat(g1)).view(r, g1, v)
    p = processed_probs(logits.reshape(r * g1, v), st.repeat(g1)).view(r, g1, v)
    if not raced:
        u = torch.rand(r, g1 - 1)
        global_noise = torch.empty(r, v).exponential_()
    accepted, tokens = [], []
    for i in range(r):
        a, target = 0, logits[i].argmax(-1)
        if st.keys[i] is not None:
            target = torch.stack([(scores[i, j] - position_noise(st.keys[i], j, v).log()).argmax()
                                  for j in range(g1)])
        if st.greedy_host[i] or st.keys[i] is not None:
            while a < lens[i] and drafts[i, a] == target[a]:
                a += 1
            accepted.append(a)
            tokens.append(drafts[i, :a].tolist() + [int(target[a])])
            continue
        noise = global_noise[i]
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
        raced = rows == "seeded" and trial % 2 == 1          # as draft.py proposes them: no q
        runs = []
        for run in ("batched", "reference"):
            st = tensors(ROWS[rows], vocab, **settings)
            torch.manual_seed(50 + trial)
            if run == "batched":
                res = accept(logits, lens, DraftProposal(drafts, None if raced else q, None), st)
                a = res.num_accepted.tolist()
                out = (a, [res.tokens[i, :a[i] + 1].tolist() for i in range(r)])
            else:
                out = reference_accept(logits, lens, drafts, q, st, raced)
            runs.append((out, continuations(st)))
        assert runs[0] == runs[1]


@pytest.mark.parametrize("rows", list(ROWS))
def test_temperature_alone_gives_the_bits_of_the_repeated_rows(rows):
    """The acceptance divides each block by its request's temperature in place of repeating the
    parameters per position: the target's scores keep their bits, not only the tokens drawn."""
    r, g1, v = len(ROWS[rows]), 6, 600
    st = tensors(ROWS[rows], v)
    logits = torch.randn(r, g1, v) * 3
    want = processed_logits(logits.reshape(r * g1, v), st.repeat(g1)).view(r, g1, v)
    assert torch.equal(_target_scores(logits, st), want)
