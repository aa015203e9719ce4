"""The serving fit verdict (`glm5lab.serve_fit`, `glm5lab ledger --mode serve --gpu-memory`): the asked layout's
bytes are the ledger's own (`tp_serve`, `serve_bytes`), and the layout it proposes is the first of its search that
fits, every earlier one not fitting."""

from glm5lab.cli import main
from glm5lab.config import ModelConfig
from glm5lab.deployment import serve_bytes
from glm5lab.fit_plan import GIB
from glm5lab.serve_fit import _ep_layouts, _tp_layouts, serve_fit
from glm5lab.tensor_parallel import tp_serve

GLM5 = ModelConfig.from_preset("glm5")


def test_tp8_fp8_fits_on_141_gib_and_not_on_80():
    d = tp_serve(GLM5, gpus=8, tp=8, dtype="fp8")
    v = serve_fit(GLM5, gpus=8, ep=1, tp=8, dtype="fp8", gpu_memory=141)
    assert v["fits"] and v["asked"]["bytes"] == d["per_gpu_bytes"]["total"]
    v = serve_fit(GLM5, gpus=8, ep=1, tp=8, dtype="fp8", gpu_memory=80)
    assert not v["fits"] and v["plan"] == {"gpus": 16, "ep": 1, "tp": 8,
                                           "bytes": tp_serve(GLM5, gpus=16, tp=8, dtype="fp8")["per_gpu_bytes"]["total"]}
    assert v["plan"]["bytes"] <= 80 * GIB


def test_ep_layout_grows_ep_to_the_first_that_fits():
    v = serve_fit(GLM5, gpus=8, ep=8, dtype="fp8", gpu_memory=80)
    tried = list(_ep_layouts(GLM5, 8, 8, 4096))
    first = next(i for i, (g, e, _) in enumerate(tried) if serve_bytes(GLM5, e, "fp8", "fp8", None, 1)["total"] <= 80 * GIB)
    g, e, _ = tried[first]
    assert v["plan"] == {"gpus": g, "ep": e, "tp": None, "bytes": serve_bytes(GLM5, e, "fp8", "fp8", None, 1)["total"]}
    assert (g, e) == (16, 16) and g % e == 0 and GLM5.n_routed_experts % e == 0


def test_tp_search_order_fewest_gpus_then_smallest_tp():
    layouts = list(_tp_layouts(GLM5, 8, 1, 8, 64))
    assert layouts[0] == (8, 1, 8) and [g for g, _, _ in layouts] == sorted(g for g, _, _ in layouts)
    assert serve_fit(GLM5, gpus=8, ep=1, tp=8, gpu_memory=1)["plan"] is None


def test_cli_prints_the_verdict_and_refuses_it_without_a_mode(capsys):
    assert main(["ledger", "--gpus", "8", "--tp", "8", "--mode", "serve", "--dtype", "fp8", "--gpu-memory", "80"]) == 0
    assert capsys.readouterr().out.splitlines()[-1] == (
        "fit on 80 GiB GPUs: --gpus 8 --tp 8 --ep 1 needs 100.0 GiB per GPU (weights + cache): it does not fit. "
        "Smallest layout of this kind that fits: --gpus 16 --tp 8 --ep 1, 57.2 GiB per GPU")
    assert main(["ledger", "--gpu-memory", "80"]) == 2
    assert "--gpu-memory = 80.0 is not allowed: only with --gpus, --ep and --mode serve" in capsys.readouterr().err
