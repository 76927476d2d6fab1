"""What a run learned, in real gloo runs of train.py: generations at every evaluation (greedy
tokens equal transformers' ``generate`` on the unsharded model, at 1 rank, 2 full, 4 hybrid with
LoRA, TP 2 and EP 2; uneven prompts per rank; a resumed run), lm-evaluation-harness scores (in
training on the sharded model = ``fsdp-lab eval`` on its export = lm-eval's own HFLM there), the
trackers read back, and the one-line refusals.

The runs start from a pretrained-looking tiny model (tests/integration/test_models.save_tiny), so
step 0's samples come from weights the reference can load as they are.
"""

from __future__ import annotations

import json

import pytest
import torch
from conftest import check_ok, run_python, train
from mlflow_server import mlflow_server
from test_models import save_tiny
from wandb_files import offline_runs

from fsdp_lab.observe.run_logs import read_metrics

pytestmark = pytest.mark.slow
pytest.importorskip("lm_eval")

# Five prompts of different lengths: 3 + 2 on 2 ranks, 2 + 1 + 1 + 1 on 4 (eval.batch_size=2:
# rank 0 runs two batches, the others one and a placeholder).
PROMPTS = ["ROMEO:", "O", "What light through yonder window breaks", "KING HENRY:", "Be"]
NEW_TOKENS = 10
TASKS = "lab_facts_mc,lab_facts_gen"
LIMIT = 6  # documents per task: the scores are compared, not judged


def base(model_dir) -> tuple[str, ...]:
    return (
        "hardware=cpu",
        "model=local",
        f"model.name_or_path={model_dir}",
        "model.pretrained=true",
        "trainer.max_steps=2",
        "trainer.eval_every=2",
        "trainer.micro_batch_size=1",
        "trainer.seq_len=32",
        "optim.lr=1e-2",
        f"eval.prompts=[{','.join(json.dumps(p) for p in PROMPTS)}]",
        f"eval.max_new_tokens={NEW_TOKENS}",
        "eval.batch_size=2",
        "logger=none",
        "checkpoint=none",
    )


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    path = tmp_path_factory.mktemp("llama")
    save_tiny(path)
    return path


@pytest.fixture(scope="module")
def moe(tmp_path_factory):
    """A tiny Qwen3-MoE with weights (8 experts, top-2) and a byte-level tokenizer."""
    from transformers import ByT5Tokenizer, Qwen3MoeConfig, Qwen3MoeForCausalLM

    path = tmp_path_factory.mktemp("moe")
    config = Qwen3MoeConfig(
        vocab_size=259,
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=128,
        moe_intermediate_size=32,
        num_experts=8,
        num_experts_per_tok=2,
        max_position_embeddings=256,
        bos_token_id=0,
        eos_token_id=1,
    )
    torch.manual_seed(7)
    Qwen3MoeForCausalLM(config).save_pretrained(path)
    ByT5Tokenizer(extra_ids=0).save_pretrained(path)
    return path


def reference(model_dir) -> list[str]:
    """Each prompt's greedy completion by transformers' generate on the whole model."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(model_dir)
    out = []
    for prompt in PROMPTS:
        ids = tok(prompt)["input_ids"][:-1]  # ByT5 appends EOS: the prompt goes on instead
        gen = model.generate(
            torch.tensor([ids]),
            max_new_tokens=NEW_TOKENS,
            do_sample=False,
            eos_token_id=tok.eos_token_id,
            pad_token_id=tok.pad_token_id,
        )[0, len(ids) :].tolist()
        out.append(tok.decode(gen, skip_special_tokens=True))
    return out


def samples(run_dir) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "samples.jsonl").read_text().splitlines()]


def outputs_at(run_dir, step: int) -> list[str]:
    rows = [s for s in samples(run_dir) if s["step"] == step]
    assert [s["index"] for s in rows] == list(range(len(PROMPTS)))
    return [s["output"] for s in rows]


@pytest.mark.parametrize(
    "overrides",
    [
        ("hardware.nproc_per_node=1",),
        (
            "hardware.nproc_per_node=4",
            "sharding=hybrid",
            "finetune=lora",
            "eval.keep_gathered=true",
        ),
        # TP 2 x CP 2: generation runs whole sequences under SDPA on every rank of the group
        ("hardware.nproc_per_node=4", "sharding=full", "parallel.tensor=2", "parallel.context=2"),
        # PP 2: the whole model gathered on every rank from its stages for the block
        (
            "hardware.nproc_per_node=2",
            "parallel.pipeline=2",
            "parallel.pipeline_schedule=GPipe",
            "parallel.pipeline_microbatches=1",
        ),
    ],
    ids=["1-rank", "4-hybrid-lora", "4-tp2-cp2", "2-pp2"],
)
def test_greedy_samples_equal_generate_on_the_whole_model(llama, tmp_path, overrides):
    run_dir = tmp_path / "run"
    check_ok(train(run_dir, *base(llama), *overrides))
    assert outputs_at(run_dir, 0) == reference(llama)
    assert len(outputs_at(run_dir, 2)) == len(PROMPTS)  # and after the last step


def test_expert_parallel_samples_equal_generate(moe, tmp_path):
    run_dir = tmp_path / "run"
    ep = ("hardware.nproc_per_node=2", "parallel.expert=2", "eval.keep_gathered=true")
    check_ok(train(run_dir, *base(moe), *ep))
    assert outputs_at(run_dir, 0) == reference(moe)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with mlflow_server(tmp_path_factory.mktemp("mlflow")) as uri:
        yield uri


@pytest.fixture(scope="module")
def full_run(llama, tmp_path_factory, server):
    """2 ranks fully sharded (one CP group: training splits each sequence over it, generation
    and scoring run whole ones), with harness tasks, an export and every tracker."""
    run_dir = tmp_path_factory.mktemp("full") / "run"
    check_ok(
        train(
            run_dir,
            *base(llama),
            "hardware.nproc_per_node=2",
            "parallel.context=2",
            f"eval.harness_tasks=[{TASKS}]",
            "eval.harness_include_path=tests/harness_tasks",
            f"eval.harness_limit={LIMIT}",
            "checkpoint=sharded",
            "checkpoint.every_n_steps=1",
            "checkpoint.export_hf=true",
            "logger=[wandb,tensorboard,mlflow]",
            "logger.wandb.mode=offline",
            f"logger.mlflow.tracking_uri={server}",
        )
    )
    return run_dir


def test_two_ranks_samples_and_a_resumed_run_continues_them(full_run, llama, tmp_path):
    assert outputs_at(full_run, 0) == reference(llama)
    assert sorted({s["step"] for s in samples(full_run)}) == [0, 2]
    assert all(
        s["tokens"] <= NEW_TOKENS and s["prompt"] == PROMPTS[s["index"]] for s in samples(full_run)
    )
    # Resumed from step 1 in a run dir of its own: samples at its boundaries only (not step 0),
    # the same text at step 2 as the uninterrupted run.
    resumed = tmp_path / "resumed"
    ckpt = full_run / "checkpoints" / "step_00000001"
    overrides = (*base(llama), "hardware.nproc_per_node=2", "parallel.context=2", f"resume={ckpt}")
    check_ok(train(resumed, *overrides))
    assert sorted({s["step"] for s in samples(resumed)}) == [2]
    assert outputs_at(resumed, 2) == outputs_at(full_run, 2)


def _hflm_scores(model_dir) -> dict[str, float]:
    """lm-eval's own HFLM on the export, in a process of its own."""
    script = (
        "import json, lm_eval\n"
        "from lm_eval.models.huggingface import HFLM\n"
        "from lm_eval.tasks import TaskManager\n"
        f"lm = HFLM(pretrained={str(model_dir)!r}, batch_size=3, device='cpu', dtype='float32')\n"
        "tm = TaskManager(include_path='tests/harness_tasks', include_defaults=False)\n"
        f"r = lm_eval.simple_evaluate(model=lm, tasks={TASKS.split(',')!r}, task_manager=tm,\n"
        f"    limit={LIMIT}, bootstrap_iters=0)\n"
        "print(json.dumps({f'{t}/{m.removesuffix(\",none\")}': v\n"
        "    for t, ms in r['results'].items() for m, v in ms.items()\n"
        "    if ',' in m and 'stderr' not in m}))\n"
    )
    proc = run_python(["-c", script], env={"HF_DATASETS_OFFLINE": "1"})
    check_ok(proc)
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_harness_in_training_equals_the_export_and_lm_evals_hflm(full_run):
    facts = json.loads((full_run / "run.json").read_text())
    in_training = facts["harness"]
    assert facts["harness_step"] == 2 and facts["harness_source"] == "sharded"
    assert set(in_training) == {
        "lab_facts_mc/acc",
        "lab_facts_mc/acc_norm",
        "lab_facts_gen/exact_match",
    }
    rows = read_metrics(full_run / "metrics.jsonl", "harness")
    assert [r["step"] for r in rows] == [2] and rows[0]["scores"] == in_training

    proc = run_python(
        [
            "-m",
            "fsdp_lab.tools.cli",
            "eval",
            str(full_run),
            "--tasks",
            TASKS,
            "--limit",
            str(LIMIT),
            "--include-path",
            "tests/harness_tasks",
            "--json",
        ]
    )
    check_ok(proc)
    exported = json.loads(proc.stdout[proc.stdout.index("{") : proc.stdout.rindex("}") + 1])
    assert exported == pytest.approx(in_training)
    assert _hflm_scores(full_run / "hf") == pytest.approx(exported)
    after = json.loads((full_run / "run.json").read_text())
    assert after["harness_source"] == "export" and after["harness"] == pytest.approx(exported)


def test_trackers_hold_the_samples_and_scores(full_run, server):
    # W&B (offline): a `samples` table per evaluation, the scores as harness/<task>/<metric>.
    run = offline_runs(full_run)[0]
    tables = sorted((full_run / "wandb").glob("offline-run-*/files/media/table/samples_*.json"))
    last = json.loads(tables[-1].read_text())
    assert last["columns"] == ["step", "index", "prompt", "output", "tokens"]
    assert [row[3] for row in last["data"]] == [s["output"] for s in samples(full_run)]
    logged = {k for h in run.history for k in h}
    assert "harness/lab_facts_mc/acc" in logged
    # MLflow: one text artifact per evaluation, and the scores as metrics.
    from mlflow.tracking import MlflowClient

    facts = json.loads((full_run / "run.json").read_text())
    client, run_id = MlflowClient(server), facts["trackers"]["mlflow"]["run_id"]
    names = sorted(a.path for a in client.list_artifacts(run_id, "samples"))
    assert names == ["samples/step_0000000.jsonl", "samples/step_0000002.jsonl"]
    keys = client.get_run(run_id).data.metrics
    assert "harness/lab_facts_gen/exact_match" in keys
    # TensorBoard: each prompt's completion as text at each evaluation.
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(full_run / "tensorboard"), size_guidance={"tensors": 0})
    acc.Reload()
    events = acc.Tensors("samples/0/text_summary")
    assert [e.step for e in events] == [0, 2]
    last = events[-1].tensor_proto.string_val[0].decode()
    assert PROMPTS[0] in last and outputs_at(full_run, 2)[0] in last
    assert "harness/lab_facts_mc/acc" in acc.Tags()["scalars"]


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (("eval.harness_tasks=[no_such_task]",), "unknown task no_such_task"),
        (("eval.prompts=/nonexistent/prompts.jsonl",), "eval.prompts=/nonexistent/prompts.jsonl"),
        (("eval.max_new_tokens=256",), "eval.max_new_tokens=256 leaves no room"),
        (
            ("eval.prompts=[[{role:user,content:hi}]]",),
            "eval.prompts holds chat messages, but the tokenizer",
        ),
    ],
    ids=["unknown-task", "missing-prompts", "too-many-tokens", "chat-without-template"],
)
def test_bad_eval_settings_fail_in_one_line_before_any_rank(llama, tmp_path, overrides, message):
    proc = train(tmp_path / "run", *base(llama), "hardware.nproc_per_node=2", *overrides)
    assert proc.returncode != 0
    errors = [line for line in proc.stderr.splitlines() if "error" in line.lower()]
    assert any(message in line for line in errors), proc.stderr[-2000:]
    assert not (tmp_path / "run" / "logs").exists()  # no rank started


@pytest.mark.parametrize(
    ("status", "export", "message"),
    [("completed", False, "fsdp-lab export {run_dir}"), ("running", True, "is still running")],
)
def test_eval_cli_refuses_a_run_dir_without_an_export_or_still_running(
    llama, tmp_path, status, export, message
):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "run.json").write_text(json.dumps({"status": status}))
    if export:
        save_tiny(run_dir / "hf")
    proc = run_python(["-m", "fsdp_lab.tools.cli", "eval", str(run_dir), "--tasks", TASKS])
    assert proc.returncode == 2, proc.stderr
    assert message.format(run_dir=run_dir) in proc.stderr.replace("\n", " ")
    assert json.loads((run_dir / "run.json").read_text()) == {"status": status}
