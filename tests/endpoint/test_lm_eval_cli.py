"""The real ``lm_eval`` command line scores CoVeil through ``coveil edge serve``, as docs/guides/endpoint.md tells a
researcher to run it: the two shipped tasks (eval_harness/lm_eval_tasks: MedPriv's questions as multiple choice,
a loglikelihood task, and as generation, a generate-until task) over the repository's own file with the hub
switched off, ``--model local-completions`` against the endpoint on loopback, the run's private context set with
``--private-context-file``. The results hold both tasks' metrics; every SLM prompt of the run begins with the
private context; no cloud transcript holds it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from edge_sdk.prompts import CONTEXT_SEPARATOR
from edge_sdk.server.serving import EdgeServing
from tests.endpoint.test_structured_output import transcripts
from tests.support.endpoint_stack import CANARY, PRIVATE_CONTEXT, Cloud, Endpoint, LogCapture, start_endpoint

pytestmark = pytest.mark.model

ROOT = Path(__file__).resolve().parents[2]
TASKS = ROOT / "eval_harness" / "lm_eval_tasks"
LIMIT = 1  # documents per task: 4 loglikelihood requests (one per choice), 1 generation
#: what the guide's recipe sets so nothing reaches a hub (datasets, tokenizer, model files)
OFFLINE = {"HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}


@pytest.fixture(scope="module")
def endpoint(cloud: Cloud, slm, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Endpoint]:
    """``coveil edge serve --default-mode edge --private-context-file private.txt --prefill-budget-ms`` (lm-eval
    sends no coveil field; echo with logprobs is edge-side; a shorter budget than the guide's, for time: each
    request's session opens on its grid)."""
    workdir = tmp_path_factory.mktemp("endpoint")
    (workdir / "private.txt").write_text(PRIVATE_CONTEXT)
    with start_endpoint(cloud.address, slm, workdir, default_mode="edge", prefill_budget_ms=100,
                        private_context_file=workdir / "private.txt") as started:
        yield started


def lm_eval_command(base_url: str, tokenizer_dir: Path, output: Path) -> list[str]:
    """The guide's command (docs/guides/endpoint.md, "lm-eval"), with this run's address and folders and
    ``--limit LIMIT`` (the guide's 2 documents per task double the requests and check nothing more)."""
    model_args = (f"model=coveil,base_url={base_url}/v1/completions,tokenizer={tokenizer_dir},"
                  "tokenizer_backend=huggingface,num_concurrent=1,max_retries=1,timeout=300")
    return [str(Path(sys.executable).parent / "lm_eval"), "--model", "local-completions", "--model_args", model_args,
            "--include_path", "eval_harness/lm_eval_tasks", "--tasks", "coveil_medpriv_mc,coveil_medpriv_gen",
            "--limit", str(LIMIT), "--batch_size", "1", "--output_path", str(output)]


def test_lm_eval_cli_scores_both_tasks_through_the_endpoint(endpoint: Endpoint, cloud: Cloud, slm,
                                                            served_tokenizer_dir: Path, server_logs: LogCapture,
                                                            tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    prompts = []  # each generation's prompts, as the endpoint built them

    def recording(prepare):
        def prepare_and_record(self, request):
            generation = prepare(self, request)
            prompts.append(generation.prompts)
            return generation
        return prepare_and_record

    monkeypatch.setattr(EdgeServing, "prepare_completion", recording(EdgeServing.prepare_completion))
    before = len(transcripts(cloud))
    env = {**os.environ, **OFFLINE, "TOKENIZERS_PARALLELISM": "false"}
    run = subprocess.run(lm_eval_command(endpoint.base_url, served_tokenizer_dir, tmp_path / "out"), cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, run.stderr[-4000:]

    [results_file] = (tmp_path / "out").rglob("results_*.json")
    results = json.loads(results_file.read_text())["results"]
    accuracy = results["coveil_medpriv_mc"]["acc,none"]
    matched = results["coveil_medpriv_gen"]["exact_match,strip"]
    assert accuracy in (0.0, 1.0) and matched in (0.0, 1.0)  # a mean over LIMIT = 1 document each

    # 4 choices x LIMIT documents scored, LIMIT generated: each one request, each conditioned on the run's private
    # context
    assert len(prompts) == 4 * LIMIT + LIMIT
    private_prefix = tuple(slm.tokenize(PRIVATE_CONTEXT + CONTEXT_SEPARATOR, add_bos=True))
    for built in prompts:
        assert built.private_text == PRIVATE_CONTEXT
        assert built.slm_ids[:len(private_prefix)] == private_prefix
    deadline = time.monotonic() + 30  # the adapter writes a transcript as its session ends, maybe after the reply
    while len(seen := transcripts(cloud)[before:]) < len(prompts) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert len(seen) == len(prompts)
    for transcript, built in zip(seen, prompts):  # the cloud read the public question, nothing before it
        assert "Question: " in slm.detokenize(list(transcript["prompt_ids"]))
    assert sorted(tuple(t["prompt_ids"]) for t in seen) == sorted(built.cloud_ids for built in prompts)
    assert all(CANARY not in json.dumps(t) and "jaundice" not in json.dumps(t) for t in seen)
    assert CANARY not in server_logs.text and CANARY not in run.stdout + run.stderr
