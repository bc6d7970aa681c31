"""recipes/train.py under more than one process: 2 ranks on the CPU (gloo) here; 2 GPUs under DDP and FSDP2 in the
gpu tests. The model is wrapped there (DDP), ranks draw different data and the report gathers per-rank figures."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "recipes"))
TINY = [  # the tiny_cpu recipe shrunk further: seconds per implementation in the Triton interpreter
    "--config", str(REPO / "configs" / "tiny_cpu.yaml"), "--seq_len", "32", "--batch_size", "2", "--steps", "2",
    "--warmup_steps", "1", "--hidden_size", "32", "--num_heads", "2", "--num_kv_heads", "1",
    "--intermediate_size", "64", "--corpus_max_bytes", "300000", "--plots", "false",
]


def launch(accelerate_config: str, args: list[str], cwd: Path, timeout: int) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file",
           str(REPO / "configs" / "accelerate" / accelerate_config), str(REPO / "recipes" / "train.py"), *args]
    # the repository first, then whatever the caller had (a GPU machine may carry packages there)
    path = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p)
    # a test's run is no measurement: its figures stay out of results/history.csv
    env = {**os.environ, "PYTHONPATH": path, "OMP_NUM_THREADS": "1", "FLASHPATCH_HISTORY": ""}
    if accelerate_config.startswith("cpu"):  # the CPU path on a GPU machine too (cpu_ddp2.yaml's launcher is torchrun)
        env["CUDA_VISIBLE_DEVICES"] = ""
    proc = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return proc


def check_rows(res: dict, implementations: list[str], world: int) -> dict:
    """Every implementation ran on every rank and the report has its figures: total and per-rank tokens/s, one
    peak memory per rank, the same number of matmul parameters (counted on the unwrapped model)."""
    assert res["environment"]["world_size"] == world
    rows = {r["implementation"]: r for r in res["results"]}
    assert list(rows) == implementations
    memory = "peak_allocated_gib" if res["environment"]["device_type"] == "cuda" else "peak_rss_gib"
    for r in rows.values():
        assert r["status"] == "ok", r
        assert r["attn_implementation"] == r["implementation"]
        assert r["tokens_per_s"] > 0 and len(r["tokens_per_s_per_rank"]) == world
        # total = all ranks' tokens over the slowest rank's time: at most the sum of the per-rank rates
        assert r["tokens_per_s"] <= sum(r["tokens_per_s_per_rank"]) * 1.001
        assert len(r[memory]) == world and min(r[memory]) > 0
        assert r["n_matmul_params"] == rows[implementations[0]]["n_matmul_params"] > 0
    return rows


def check_traces(out: Path, implementations: list[str], world: int) -> list[dict]:
    """--profile_step's Chrome traces, one per implementation and rank; returns their events."""
    events = []
    for impl in implementations:
        for rank in range(world):
            trace = json.loads((out / "traces" / f"{impl}_rank{rank}.json").read_text())
            assert any(e.get("cat") == "cpu_op" for e in trace["traceEvents"]), (impl, rank)
            events += trace["traceEvents"]
    return events


def test_train_two_cpu_ranks(tmp_path):
    """configs/accelerate/cpu_ddp2.yaml: DDP over 2 CPU processes (the path where the wrapped model's attributes were
    once read), with the first measured step traced (and so left out of the figures)."""
    out = tmp_path / "run"
    args = [*TINY, "--implementations", "eager,sdpa,fpatch", "--profile_step", "2", "--output_dir", str(out)]
    proc = launch("cpu_ddp2.yaml", args, tmp_path, timeout=300)
    res = json.loads((out / "results.json").read_text())
    assert res["environment"]["distributed_type"] == "DistributedType.MULTI_CPU"
    rows = check_rows(res, ["eager", "sdpa", "fpatch"], world=2)
    for r in rows.values():
        assert r["real_tokens"] == r["padded_tokens"] == 2 * 1 * 2 * 32  # 2 ranks x 1 untraced step x 2 rows x 32
        assert len(r["losses"]) == 3 and r["measured_steps"] == len(r["step_times_ms"]) == 1
    for impl in ("sdpa", "fpatch"):  # same init, same per-rank batches: the rank-mean losses agree
        np.testing.assert_allclose(rows[impl]["losses"], rows["eager"]["losses"], rtol=1e-4)
    assert "batch 2 x 2" in proc.stdout  # 2 ranks, not 2 independent single-process runs
    assert "fpatch per rank: peak RSS " in proc.stdout  # each rank's memory and tokens/s under the table
    check_traces(out, ["eager", "sdpa", "fpatch"], world=2)
    assert rows["fpatch"]["traced_step"] == 2 and rows["fpatch"]["traced_step_ms"] > 0


def test_rounds_two_cpu_ranks(tmp_path):
    """--rounds: one model, the implementations in turns with the order rotated; per-round figures and ratios."""
    out = tmp_path / "run"
    proc = launch("cpu_ddp2.yaml", [*TINY, "--implementations", "eager,sdpa,fpatch", "--rounds", "2",
                                    "--output_dir", str(out)], tmp_path, timeout=300)
    res = json.loads((out / "results.json").read_text())
    assert res["ranking"]["orders"] == [["eager", "sdpa", "fpatch"], ["sdpa", "fpatch", "eager"]]
    rows = check_rows(res, ["eager", "sdpa", "fpatch"], world=2)
    for r in rows.values():
        assert r["measured_steps"] == 4 and len(r["step_times_ms"]) == 4 and len(r["round_tokens_per_s"]) == 2
        assert r["real_tokens"] == 2 * 2 * 2 * 2 * 32  # 2 ranks x 2 rounds x 2 steps x 2 rows x 32
        assert len(r["losses"]) == 1 + 4  # warm-up + measured
        # the overall ratio is a time-weighted mean of the paired per-round ones
        assert min(r["vs_sdpa_rounds"]) == r["vs_sdpa_min"] <= r["vs_sdpa"] + 1e-4
        assert r["vs_sdpa"] <= r["vs_sdpa_max"] + 1e-4 and max(r["vs_sdpa_rounds"]) == r["vs_sdpa_max"]
    assert rows["sdpa"]["vs_sdpa_rounds"] == [1.0, 1.0]
    assert rows["fpatch"]["vs_sdpa_max"] < 0.5  # the Triton interpreter: far slower on every round
    # step by step on the same batches: sdpa against itself is 1, the interpreter far below on every step
    assert rows["sdpa"]["vs_sdpa_paired"] == rows["sdpa"]["vs_sdpa_paired_q3"] == 1.0
    fp = rows["fpatch"]
    assert fp["vs_sdpa_paired_q1"] <= fp["vs_sdpa_paired"] <= fp["vs_sdpa_paired_q3"]
    assert rows["fpatch"]["vs_sdpa_paired_q3"] < 0.5
    lines = [line for line in proc.stdout.splitlines() if line.strip()]
    header = next(i for i, line in enumerate(lines) if line.startswith("| implementation |"))
    assert "| vs sdpa (rounds min-max) | vs sdpa, paired steps (quartiles) |" in lines[header]
    assert [line.split("|")[1].strip() for line in lines[header + 2:header + 5]] == ["eager", "sdpa", "fpatch"]


def test_balanced_ranks_two_cpu_ranks(tmp_path):
    """--balance_ranks on padded rows: the ranks' rows dealt by real tokens under a real 2-process launch; every
    implementation trains the same balanced rows, so their real-token counts agree."""
    out = tmp_path / "run"
    proc = launch("cpu_ddp2.yaml", [*TINY, "--implementations", "sdpa,fpatch", "--data_mode", "unpadded",
                                    "--balance_ranks", "true", "--output_dir", str(out)], tmp_path, timeout=300)
    res = json.loads((out / "results.json").read_text())
    rows = check_rows(res, ["sdpa", "fpatch"], world=2)
    assert rows["sdpa"]["real_tokens"] == rows["fpatch"]["real_tokens"] > 0
    assert res["config"]["balance_ranks"] is True and res["environment"]["balanced_ranks"] is True
    assert "rows balanced across ranks" in proc.stdout


def test_profile_step_setting():
    from train_config import parse_config

    assert parse_config(["--profile_step", "3"]).profile_step == 3
    with pytest.raises(ValueError, match="past the last step"):
        parse_config(["--profile_step", "11"])  # tiny_cpu: 2 warm-up + 8 measured


def test_rounds_settings():
    from train_config import parse_config

    assert parse_config(["--rounds", "6", "--steps", "4"]).rounds == 6
    with pytest.raises(ValueError, match="compile"):
        parse_config(["--rounds", "2", "--compile", "default"])
    with pytest.raises(ValueError, match="profile_step"):
        parse_config(["--rounds", "2", "--profile_step", "1"])


def test_paired_ratios_and_slow_steps():
    import ranking

    # one stalled step (the 4th of fpatch's) drags tokens/s; the paired median moves by one place only
    sdpa = [100.0, 100.0, 100.0, 100.0, 120.0, 120.0]
    fpatch = [80.0, 80.0, 80.0, 2000.0, 96.0, 96.0]
    paired = ranking.paired_ratios(sdpa, fpatch)
    assert paired["vs_sdpa_paired"] == 1.25 and paired["vs_sdpa_paired_q1"] == 1.25
    assert round(sum(sdpa) / sum(fpatch), 3) == 0.263  # what tokens/s over the steps would say
    assert ranking.paired_ratios(sdpa, sdpa) == {"vs_sdpa_paired": 1.0, "vs_sdpa_paired_q1": 1.0,
                                                  "vs_sdpa_paired_q3": 1.0}
    assert ranking.paired_ratios([50.0], [25.0])["vs_sdpa_paired"] == 2.0
    assert ranking.paired_ratios([], []) == {}
    assert ranking.slow_steps(fpatch, 3) == [[2, 1, 2000.0]]  # round 2, its first step
    assert ranking.slow_steps(sdpa, 3) == []
    report = {"results": [{"implementation": "fpatch", "slow_steps": [[2, 1, 2000.0]], "measured_steps": 6},
                          {"implementation": "sdpa", "slow_steps": [], "measured_steps": 6}]}
    notes = ranking.slow_step_notes(report)
    assert len(notes) == 1
    assert "fpatch: 1 of 6 steps took over 3x its median step (round 2 step 1: 2,000 ms)" in notes[0]


def test_rounds_rotate_the_order():
    import ranking

    assert ranking.orders(["a", "b"], 4) == [["a", "b"], ["b", "a"], ["a", "b"], ["b", "a"]]
    assert [o[0] for o in ranking.orders(["a", "b", "c"], 3)] == ["a", "b", "c"]


# --- 2 GPUs: run by tools/gpu_suite.sh on a 2-GPU machine ---------------------------------------------------------

SMALL_GPU = [  # a small bf16 Llama: seconds per implementation, flex_attention's compile aside
    "--config", str(REPO / "configs" / "llama_125m.yaml"), "--hidden_size", "256", "--num_layers", "4",
    "--num_heads", "4", "--num_kv_heads", "2", "--head_dim", "64", "--intermediate_size", "768", "--seq_len", "512",
    "--batch_size", "2", "--warmup_steps", "2", "--steps", "3", "--plots", "false",
]
ALL = ["eager", "sdpa", "flex_attention", "fpatch"]


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
@pytest.mark.parametrize("accelerate_config", ["ddp_2gpu.yaml", "fsdp2_2gpu.yaml"])
def test_train_two_gpus(tmp_path, accelerate_config):
    """Every implementation under DDP and FSDP2, the first measured step traced (NCCL kernels in the trace)."""
    out = tmp_path / "run"
    launch(accelerate_config, [*SMALL_GPU, "--implementations", ",".join(ALL), "--profile_step", "3",
                               "--output_dir", str(out)], tmp_path, timeout=900)
    res = json.loads((out / "results.json").read_text())
    rows = check_rows(res, ALL, world=2)
    for r in rows.values():
        assert r["measured_steps"] == 2 and r["real_tokens"] == 2 * 2 * 2 * 512  # step 3 traced, not measured
        assert len(r["peak_reserved_gib"]) == 2 and r["model_tflops_per_s"] > 0
        np.testing.assert_allclose(r["losses"][0], rows["sdpa"]["losses"][0], rtol=2e-2)  # same init and batch
    events = check_traces(out, ALL, world=2)
    assert any(e.get("cat") == "kernel" and "nccl" in e.get("name", "").lower() for e in events)


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_rounds_two_gpus_fsdp2(tmp_path):
    out = tmp_path / "run"
    launch("fsdp2_2gpu.yaml", [*SMALL_GPU, "--implementations", "sdpa,fpatch", "--rounds", "4",
                               "--output_dir", str(out)], tmp_path, timeout=900)
    res = json.loads((out / "results.json").read_text())
    rows = check_rows(res, ["sdpa", "fpatch"], world=2)
    assert len(rows["fpatch"]["vs_sdpa_rounds"]) == 4 and rows["fpatch"]["vs_sdpa_min"] > 0
