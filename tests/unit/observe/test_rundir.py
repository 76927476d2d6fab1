"""The run dir's files: run.json claimed once, updated atomically, the config round-trips."""

from __future__ import annotations

import json

from fsdp_lab.config import Config, ModelArch, ModelConfig, to_container
from fsdp_lab.observe import rundir
from fsdp_lab.observe.record import RunRecord


def test_run_json_is_created_once_and_updated_keeping_the_other_facts(tmp_path):
    assert rundir.create_run_file(tmp_path, RunRecord(status="starting", job={"num": 0}))
    assert not rundir.create_run_file(tmp_path, RunRecord(status="mine"))  # another launch lost
    rundir.update_run_file(tmp_path, status="failed", error="rank 1 died")
    assert rundir.read_run_file(tmp_path).to_dict() == {
        "status": "failed",
        "job": {"num": 0},
        "error": "rank 1 died",
    }
    assert [p.name for p in tmp_path.iterdir()] == [rundir.RUN_FILE]  # no .tmp left behind
    assert json.loads((tmp_path / rundir.RUN_FILE).read_text())["status"] == "failed"


def test_a_missing_run_json_reads_as_no_facts(tmp_path):
    assert rundir.read_run_file(tmp_path).to_dict() == {}


def test_the_resolved_config_round_trips(tmp_path):
    cfg = Config(seed=7, model=ModelConfig(arch=ModelArch.llama))
    rundir.save_run_config(cfg, tmp_path)
    assert to_container(rundir.load_run_config(tmp_path)) == to_container(cfg)


def test_each_rank_has_its_error_file_under_logs(tmp_path):
    assert rundir.error_file(tmp_path, 3) == tmp_path / rundir.LOG_DIR / "rank3.error.json"
