"""`GLM5ForCausalLM.forward` input checks: a wrong input is refused with an error that names it,
before any layer runs (not a raw reshape or embedding error from deep inside)."""

import numpy as np
import pytest
import torch


@pytest.mark.parametrize("ids, error, match", [
    ([[1, 2, 3]], TypeError, r"input_ids must be a torch.LongTensor \[batch, seq\], got list"),
    (np.array([[1, 2, 3]]), TypeError, "got ndarray.*torch.as_tensor"),
    (torch.zeros(0, 5, dtype=torch.long), ValueError, "input_ids has 0 rows"),
    (torch.zeros(2, 0, dtype=torch.long), ValueError, "sequence length 0"),
    (torch.zeros(5, dtype=torch.long), ValueError, r"integer tensor \[batch, seq\]"),
    (torch.zeros(1, 5), ValueError, "integer tensor"),
    (torch.full((1, 5), 512), ValueError, r"\[0, vocab_size=512\)"),
])
def test_bad_input_ids_are_refused(tiny_model, ids, error, match):
    with pytest.raises(error, match=match):
        tiny_model(ids)


@pytest.mark.parametrize("depth, error, match", [
    (True, TypeError, "mtp_depth must be an int, got True"),
    (1.0, TypeError, "mtp_depth must be an int, got 1.0"),
    ("2", TypeError, "mtp_depth must be an int, got '2'"),
    (None, TypeError, "mtp_depth must be an int, got None"),
    (-1, ValueError, "mtp_depth=-1 is not allowed"),
])
def test_bad_mtp_depth_is_refused(tiny_model, depth, error, match):
    with pytest.raises(error, match=match):
        tiny_model(torch.zeros(1, 5, dtype=torch.long), mtp_depth=depth)


def test_int32_ids_and_one_row_still_run(tiny_model):
    with torch.no_grad():
        out = tiny_model(torch.zeros(1, 5, dtype=torch.int32), mtp_depth=2)
    assert out.logits.shape == (1, 5, 512) and [t.shape[1] for t in out.mtp_logits] == [4, 3]
