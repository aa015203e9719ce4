"""The kind of state every MTP depth receives: post-norm at every depth (issue 11).

Depth 1 reads the main model's hidden state after its final norm; depths 2..D must read the
previous depth's output after `shared_head.norm` (Megatron-LM's chain, which trained GLM-5; vLLM's
and SGLang's GLM-5 drafting), never the raw block output. Hooks record what the MTP layer is fed
and what the two norms return, in the training unroll and in the speculative draft loop; every
vector the layer receives must be, bit for bit, a row some post-norm produced."""

import torch

import glm5lab
from glm5lab import GLM5ForCausalLM, ModelConfig


def _model():
    torch.manual_seed(0)
    model = GLM5ForCausalLM(ModelConfig.from_preset("tiny")).eval()
    with torch.no_grad():  # norm weights far from 1, so a normed state and a raw one cannot pass for each other
        for norm in (model.model.norm, model.model.mtp_layers[0].shared_head.norm):
            norm.weight.uniform_(0.2, 2.0)
    return model


class Recorder:
    """What the MTP layer receives (its first argument) and what each norm returns, in call order."""

    def __init__(self, model):
        mtp = model.model.mtp_layers[0]
        self.inputs, self.main, self.mtp_out = [], [], []
        self.handles = [
            mtp.register_forward_pre_hook(lambda m, args: self.inputs.append(args[0].detach().clone())),
            model.model.norm.register_forward_hook(lambda m, a, out: self.main.append(out.detach().clone())),
            mtp.shared_head.norm.register_forward_hook(lambda m, a, out: self.mtp_out.append(out.detach().clone())),
        ]

    def close(self):
        for h in self.handles:
            h.remove()


def _rows(tensors) -> set[bytes]:
    return {row.numpy().tobytes() for t in tensors for row in t.reshape(-1, t.shape[-1])}


def test_training_unroll_feeds_every_depth_the_post_norm_state():
    model, ids = _model(), torch.randint(0, 512, (2, 14), generator=torch.Generator().manual_seed(1))
    rec = Recorder(model)
    with torch.no_grad():
        model(ids, mtp_depth=3)
    rec.close()
    assert len(rec.inputs) == 3 and len(rec.main) == 1 and len(rec.mtp_out) == 3
    assert torch.equal(rec.inputs[0], rec.main[0][:, :13])  # depth 1: the main model's final norm
    for j in (2, 3):  # depth j: depth j-1's output after shared_head.norm
        assert torch.equal(rec.inputs[j - 1], rec.mtp_out[j - 2][:, :14 - j]), f"depth {j} got another state"


def test_draft_loop_feeds_every_step_a_post_norm_state():
    model = _model()
    prompts = [[5, 17, 200, 3, 99, 42, 7, 300, 11], [8, 1, 400, 23]]  # two rows of different lengths
    rec = Recorder(model)
    out = glm5lab.generate(model, prompts, 12, speculative="mtp", draft_steps=3, seed=0)
    rec.close()
    assert all(len(t) == 12 for t in out.tokens)
    post_norm = _rows(rec.main) | _rows(rec.mtp_out)
    chained = _rows(rec.mtp_out)
    fed = [row.numpy().tobytes() for t in rec.inputs for row in t.reshape(-1, t.shape[-1])]
    assert len(fed) > 0 and all(r in post_norm for r in fed), "the draft head received a pre-norm state"
    n_chained = sum(r in chained for r in fed)
    assert n_chained >= out.stats.verify_steps  # each round chains drafts 2..k from the MTP head's own output
