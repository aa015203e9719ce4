"""Speculative decoding's accept rule (`glm5lab.infer.speculative`) and, end to end, that MTP
speculative sampling through `generate` outputs the target model's distribution.

Statistical tests compare empirical distributions with exact ones by total variation (TV), with
the TV an honest sample of that size shows as the yardstick (printed; run with -s to see it):
for a distribution p over n outcomes and N samples, E[TV] ~ 0.5 * sqrt(2 / (pi N)) * sum_i
sqrt(p_i (1 - p_i)). Each test also shows that a plausible wrong rule lands far above the bar."""

import itertools

import pytest
import torch

from glm5lab import GLM5ForCausalLM, ModelConfig, generate
from glm5lab.infer.sampling import Sampling, distribution
from glm5lab.infer.speculative import AcceptanceStats, accept_drafts
from glm5lab.model.cache import KVCache


def tv(a: torch.Tensor, b: torch.Tensor) -> float:
    return 0.5 * float((a.double() - b.double()).abs().sum())


def freq(tokens: torch.Tensor, n: int) -> torch.Tensor:
    return torch.bincount(tokens, minlength=n).double() / max(tokens.numel(), 1)


def honest_tv(probs: torch.Tensor, N: int, reps: int = 100, seed: int = 0) -> float:
    """Mean TV between `probs` and the frequencies of N exact draws from it (`reps` repetitions)."""
    g = torch.Generator().manual_seed(seed)
    draws = torch.multinomial(probs.double().expand(reps, -1), N, replacement=True, generator=g)
    counts = torch.zeros(reps, probs.numel(), dtype=torch.float64).scatter_add_(
        1, draws, torch.ones_like(draws, dtype=torch.float64))
    return float(0.5 * (counts / N - probs.double()).abs().sum(-1).mean())


# -- the pure rule, vectorised over independent trials -------------------------------------------
# Target p (k+1 = 4 rows) and draft q (k = 3 rows) over V = 5, deliberately different; q1 gives
# token 0 no mass (only the residual can emit it) and p2 gives token 2 none (its draft must
# always be rejected).
P_ROWS = torch.tensor([[0.50, 0.20, 0.15, 0.10, 0.05],
                       [0.10, 0.10, 0.60, 0.10, 0.10],
                       [0.25, 0.25, 0.00, 0.25, 0.25],
                       [0.00, 0.00, 0.00, 0.30, 0.70]])
Q_ROWS = torch.tensor([[0.10, 0.40, 0.10, 0.30, 0.10],
                       [0.00, 0.10, 0.30, 0.20, 0.40],
                       [0.05, 0.05, 0.60, 0.05, 0.25]])


def test_accept_rule_emits_the_target_distribution():
    N, k, V = 300_000, 3, 5
    g = torch.Generator().manual_seed(0)
    drafts = torch.stack([torch.multinomial(Q_ROWS[i].expand(N, V), 1, generator=g)[:, 0] for i in range(k)], 1)
    n_acc, nxt = accept_drafts(P_ROWS.expand(N, k + 1, V), Q_ROWS.expand(N, k, V), drafts, Sampling(1.0), g)
    assert n_acc.shape == (N,) and nxt.shape == (N,) and n_acc.dtype == nxt.dtype == torch.int64
    assert 0 <= int(n_acc.min()) and int(n_acc.max()) <= k

    # acceptance: P(draft i accepted with all earlier) = prod_j sum_x min(p_j, q_j)
    overlap = torch.minimum(P_ROWS[:k], Q_ROWS).sum(-1)  # [0.55, 0.60, 0.40]
    for i in range(k):
        assert abs(float((n_acc > i).double().mean()) - float(overlap[:i + 1].prod())) < 0.005

    # the emitted token at position i (draft i when accepted, else the correction) ~ p_i, given
    # that every earlier draft was accepted; the bonus (all accepted) ~ p_k
    report = []
    for i in range(k + 1):
        rows = n_acc >= i
        token = torch.where(n_acc[rows] > i, drafts[rows, min(i, k - 1)], nxt[rows])
        f = freq(token, V)
        bar = honest_tv(P_ROWS[i], int(rows.sum()))
        report.append((i, int(rows.sum()), round(tv(f, P_ROWS[i]), 4), round(bar, 4)))
        assert tv(f, P_ROWS[i]) < 0.01, report
        assert bool((f[P_ROWS[i] == 0] == 0).all())  # never a token the target excludes
    print("accept rule: (position, trials, TV, honest E[TV])", report)

    # the test discriminates: "always accept the draft" emits q_0, and "on rejection resample from
    # p instead of the residual" emits min(p, q) + (1 - overlap) p; both are far from p_0
    first = torch.where(n_acc > 0, drafts[:, 0], nxt)
    resample_from_p = torch.minimum(P_ROWS[0], Q_ROWS[0]) + (1 - overlap[0]) * P_ROWS[0]
    assert tv(Q_ROWS[0], P_ROWS[0]) > 0.05 and tv(freq(first, V), Q_ROWS[0]) > 0.05
    assert tv(resample_from_p, P_ROWS[0]) > 0.05 and tv(freq(first, V), resample_from_p) > 0.05


def test_accept_rule_is_reproducible_with_a_seed():
    N, k, V = 1000, 3, 5
    drafts = torch.multinomial(Q_ROWS.repeat(N, 1), 1, generator=torch.Generator().manual_seed(1)).view(N, k)
    args = (P_ROWS.expand(N, k + 1, V), Q_ROWS.expand(N, k, V), drafts, Sampling(1.0))
    a = accept_drafts(*args, torch.Generator().manual_seed(5))
    b = accept_drafts(*args, torch.Generator().manual_seed(5))
    c = accept_drafts(*args, torch.Generator().manual_seed(6))
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    assert not (torch.equal(a[0], c[0]) and torch.equal(a[1], c[1]))


def test_greedy_rule_by_hand():
    V, k = 5, 3
    greedy = Sampling(0.0)

    def one_hot_logits(argmaxes):
        logits = torch.zeros(len(argmaxes), V)
        logits[torch.arange(len(argmaxes)), torch.tensor(argmaxes)] = 4.0
        return logits

    target_argmax = [[2, 4, 1, 3],  # every draft is the argmax -> 3 accepted, bonus = argmax of p_3
                     [0, 1, 2, 3],  # first draft wrong -> 0 accepted, correction = 0
                     [3, 3, 0, 1],  # second draft wrong -> 1 accepted, correction = 3
                     [1, 1, 1, 1]]  # third draft wrong -> 2 accepted, correction = 1
    drafts = torch.tensor([[2, 4, 1], [4, 1, 2], [3, 2, 0], [1, 1, 0]])
    logits = torch.stack([one_hot_logits(a) for a in target_argmax])
    # a fifth row with a tie in the target: the lowest id wins, so draft 1 is rejected for 0
    tie = torch.zeros(1, k + 1, V)
    tie[0, :, :2] = 3.0
    logits = torch.cat([logits, tie])
    drafts = torch.cat([drafts, torch.tensor([[1, 0, 0]])])
    p = distribution(logits, greedy)
    q = torch.zeros(5, k, V).scatter_(-1, drafts[..., None], 1.0)  # greedy drafts: one-hot
    n_acc, nxt = accept_drafts(p, q, drafts, greedy, None)
    assert n_acc.tolist() == [3, 0, 1, 2, 0]
    assert nxt.tolist() == [3, 0, 3, 1, 0]


def test_acceptance_stats_by_hand():
    stats = AcceptanceStats(3)
    assert stats.acceptance_rate == [0.0, 0.0, 0.0] and stats.acceptance_length == 0.0 and stats.steps == 0
    stats.add(torch.tensor([0, 2, 3]))
    stats.add(torch.tensor([1]))
    assert stats.steps == 4 and stats.accepted_at == [3, 2, 1]
    assert stats.acceptance_rate == [0.75, 0.5, 0.25]
    # mean tokens per verification: (1 + 3 + 4 + 2) / 4
    assert stats.acceptance_length == 2.5 == 1 + sum(stats.acceptance_rate)
    assert stats.as_dict() == {"draft_steps": 3, "verify_steps": 4, "acceptance_length": 2.5,
                               "acceptance_rate": [0.75, 0.5, 0.25]}
    stats.add(torch.tensor([0, 0, 0, 0]))
    assert stats.acceptance_rate == [3 / 8, 2 / 8, 1 / 8]
    assert stats.acceptance_length == pytest.approx(1 + 6 / 8) == 1 + sum(stats.acceptance_rate)


# -- end to end: generate(..., speculative="mtp") samples from the target ------------------------
# A micro model over V = 4 tokens: one MLA layer with DSA at index_topk=2 (sparse from the third
# key on), its MTP layer, dense MLP (keeps 64k rows cheap). Weights are scaled up so the target
# and the draft are peaked and clearly different (checked below).
V, PROMPT, NEW = 4, [1, 0, 2], 3


@pytest.fixture(scope="module")
def micro():
    cfg = ModelConfig.from_preset("tiny").replace(
        vocab_size=V, hidden_size=16, intermediate_size=32, num_attention_heads=2, num_key_value_heads=2,
        q_lora_rank=8, kv_lora_rank=8, qk_nope_head_dim=4, qk_rope_head_dim=4, v_head_dim=4, index_topk=2,
        index_n_heads=4, index_head_dim=8, num_hidden_layers=1, indexer_types=["full"], mlp_layer_types=["dense"],
        num_nextn_predict_layers=1, initializer_range=0.5, max_position_embeddings=16)
    torch.manual_seed(3)
    model = GLM5ForCausalLM(cfg).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(2.0)
    return model


@torch.no_grad()
def target_joint(model, sampling: Sampling) -> torch.Tensor:
    """Exact P(x1, x2, x3 | PROMPT) of plain sampling, [V**3], by full (uncached) forwards."""
    seqs = torch.tensor([PROMPT + [a, b] for a, b in itertools.product(range(V), repeat=2)])
    p = distribution(model(seqs).logits[:, -NEW:].float(), sampling).double()  # [V*V, 3, V]
    joint = torch.zeros(V, V, V, dtype=torch.float64)
    for r, (a, b) in enumerate(itertools.product(range(V), repeat=2)):
        joint[a, b] = p[r, 0, a] * p[r, 1, b] * p[r, 2]
    return joint.flatten()


@torch.no_grad()
def always_accept_tv(model, sampling: Sampling) -> float:
    """TV between the target's (x1, x2) and that of a rule that always accepts the first MTP draft:
    sum_a p(a) TV(p(. | a), q(. | a)), q = the MTP layer's distribution given x1 = a."""
    out = model(torch.tensor([PROMPT + [a] for a in range(V)]))
    p1 = distribution(out.logits[0, -2], sampling)
    total = 0.0
    for a in range(V):
        cache = KVCache.for_mtp(model, 1, 8)
        _, logits = model.mtp_step(out.hidden_states[a:a + 1, :len(PROMPT)], torch.tensor([PROMPT[1:] + [a]]),
                                   cache=cache)
        q = distribution(logits[0, -1], sampling)
        total += float(p1[a]) * tv(distribution(out.logits[a, -1], sampling), q)
    return total


@pytest.mark.parametrize("sampling, N, seed", [
    (Sampling(1.0), 64_000, 1),
    (Sampling(2.0, top_k=2, top_p=0.7), 40_000, 2),  # the target is the processed distribution
], ids=["temperature", "top_k_top_p"])
def test_speculative_sampling_matches_target_distribution(micro, sampling, N, seed):
    joint = target_joint(micro, sampling)
    assert float(joint.sum()) == pytest.approx(1.0, abs=1e-6)  # fp32 rows
    if sampling.top_k is not None:  # both restrictions bind: neither alone gives this target
        assert tv(joint, target_joint(micro, Sampling(sampling.temperature, top_p=sampling.top_p))) > 0.05
        assert tv(joint, target_joint(micro, Sampling(sampling.temperature, top_k=sampling.top_k))) > 0.05
    bar = honest_tv(joint, N)
    assert bar < 0.0045  # N is large enough: the 0.01 bar is > 4 standard deviations above an honest TV
    aa = always_accept_tv(micro, sampling)
    assert aa > 0.05  # the draft differs from the target: accepting it blindly would fail

    out = generate(micro, [PROMPT] * N, NEW, temperature=sampling.temperature, top_k=sampling.top_k,
                   top_p=sampling.top_p, seed=seed, speculative="mtp", draft_steps=3)
    tokens = torch.tensor(out.tokens)
    assert tokens.shape == (N, NEW) and out.stats.new_tokens == N * NEW
    # both branches of the rule ran: drafts were accepted and rejected
    assert 0.1 < out.stats.acceptance_rate[0] < 0.9 and len(out.stats.acceptance_rate) == 3
    emp = freq((tokens * torch.tensor([V * V, V, 1])).sum(1), V**3)
    measured = tv(emp, joint)
    print(f"\n{sampling}: N={N} TV={measured:.4f} honest E[TV]={bar:.4f} always-accept TV={aa:.3f} "
          f"acceptance_rate={[round(r, 3) for r in out.stats.acceptance_rate]}")
    assert measured < 0.01
    assert bool((emp[joint == 0] == 0).all())  # nothing outside the processed target's support
