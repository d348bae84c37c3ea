"""The dry-run estimator: shard accounting over fake ranks, stage splits, layout errors, the 405B run's speed."""

import json
import os
import time

import pytest
import torch

from tests.launch import run_module
from titan.builders import stand_in_model_args
from titan.config import parse_args
from titan.estimate.dry_run import Hardware, estimate, main
from titan.models import get_model_spec

CONFIGS = "configs/titan"
pytestmark = pytest.mark.filterwarnings("ignore:Slicing a flattened dim")

# The paper layouts, shortened where a layer count only multiplies identical blocks: the meshes, placements and
# stage positions are those of the full runs.
LAYOUTS = {
    "8B FSDP 8": ("llama3_8b_fsdp8_est", ["--model.n_layers", "2"]),
    "8B FSDP 128": ("llama3_8b_fsdp128_est", ["--model.n_layers", "2"]),
    "3.2-1B tied FSDP 8": ("llama3_8b_fsdp8_est", ["--model.flavor", "3.2-1B", "--model.n_layers", "2"]),
    "8B FSDP 2 x CP 4": ("llama3_8b_cp4_est", ["--model.n_layers", "2"]),
    "70B FSDP 32 x TP 8": ("llama3_70b_fsdp32_tp8_est", ["--model.n_layers", "2"]),
    "405B 3D 1F1B": ("llama3_405b_3d_est", ["--model.n_layers", "10"]),
    "405B 3D interleaved": ("llama3_405b_3d_est", ["--model.n_layers", "18",
                                                  "--parallelism.pipeline_parallel_schedule", "Interleaved1F1B"]),
    "8B HSDP 2 x 4 x TP 2 x PP 2 ZBV": ("llama3_8b_fsdp8_est", [
        "--model.n_layers", "5", "--comm.world_size", "32", "--parallelism.data_parallel_replicate_degree", "2",
        "--parallelism.tensor_parallel_degree", "2", "--parallelism.pipeline_parallel_degree", "2",
        "--parallelism.pipeline_parallel_schedule", "ZBVZeroBubble", "--activation_checkpoint.mode", "full"]),
    "405B TP 8 x PP 8 x FSDP 2 x CP 4": ("llama3_405b_3d_est", [
        "--model.n_layers", "10", "--parallelism.context_parallel_degree", "4", "--training.local_batch_size", "8",
        "--training.global_batch_size", "-1"]),
    "Qwen3-MoE FSDP 8 x EP 2, full AC": ("qwen3_moe_moe_debug", [
        "--comm.world_size", "8", "--parallelism.expert_parallel_degree", "2", "--activation_checkpoint.mode", "full"]),
    "DeepSeek-V3 HSDP 2 x 8 x EP 4": ("deepseek_v3_moe_debug", [
        "--comm.world_size", "16", "--parallelism.data_parallel_replicate_degree", "2",
        "--parallelism.expert_parallel_degree", "4"]),
    "DeepSeek-V3 HSDP 2 x 2 = EP 2": ("deepseek_v3_moe_debug", [
        "--comm.world_size", "4", "--parallelism.data_parallel_replicate_degree", "2",
        "--parallelism.expert_parallel_degree", "2"]),
    "DeepSeek-V3 FSDP 2 = EP 2, op SAC": ("deepseek_v3_moe_debug", [
        "--comm.world_size", "2", "--parallelism.expert_parallel_degree", "2", "--activation_checkpoint.mode",
        "selective", "--activation_checkpoint.selective_ac_option", "op"]),
    "Qwen3-MoE FSDP 4 x TP 2 x EP 2": ("qwen3_moe_moe_debug", [
        "--comm.world_size", "8", "--parallelism.tensor_parallel_degree", "2", "--parallelism.expert_parallel_degree",
        "2"]),
    "DeepSeek-V3 HSDP 2 x 2 x TP 2 = EP 2, full AC": ("deepseek_v3_moe_debug", [
        "--comm.world_size", "8", "--parallelism.data_parallel_replicate_degree", "2",
        "--parallelism.tensor_parallel_degree", "2", "--parallelism.expert_parallel_degree", "2",
        "--activation_checkpoint.mode", "full"]),
}


def _config(name, extra=()):
    return parse_args(["--config", f"{CONFIGS}/{name}.toml", *extra])


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_shards_over_all_ranks_add_up_to_the_model(layout):
    name, extra = LAYOUTS[layout]
    cfg = _config(name, extra)
    report = estimate(cfg, Hardware())
    spec = get_model_spec(cfg.model.name)
    args = stand_in_model_args(spec, cfg)
    with torch.device("meta"):
        model = spec.build_model(args)
    assert report["params_over_all_shards"] == sum(p.numel() for p in model.parameters())
    assert report["num_params"] == sum(p.numel() for p in model.parameters())
    # The analytical per-stage FLOPs add up to the trainer's FLOPs per token (the MFU numerator; an MoE model's
    # counts only the k experts a token reaches).
    lay = report["layout"]
    ranks = report["ranks"]
    local_tokens = lay["microbatch_seqs"] * lay["seq_len"] // lay["cp"]
    stage_flops = sum(r["model_flops_per_microbatch"] for r in ranks) * lay["tp"] / local_tokens
    assert stage_flops == pytest.approx(spec.flops_per_token(model, args, cfg.training.seq_len))
    assert len(ranks) == lay["pp"]
    assert sorted(s for r in ranks for s in r["stages"]) == list(range(lay["stages"]))
    assert sorted(i for r in ranks for layers in r["layers"] for i in layers) == list(range(args.n_layers))
    # AdamW: two fp32 states and one gradient per master weight; a rank's total is the sum of its parts.
    for r in ranks:
        m = r["memory_bytes"]
        assert all(v >= 0 for v in m.values()) and m["grads"] == m["params"] > 0 and m["optimizer"] == 2 * m["params"]
        assert r["memory_gib"] == pytest.approx(sum(m.values()) / 2**30)
    # Throughput: the global batch's tokens over the step time, shared by all GPUs.
    step = report["step"]
    assert step["tokens_per_s_per_gpu"] == pytest.approx(
        step["global_batch"] * lay["seq_len"] / step["step_s"] / lay["world_size"])


def test_tied_embeddings_still_pay_the_output_matmul_and_logits():
    """Llama 3.2 1B on FSDP 8, 2 x 8192 tokens per rank, bf16: its last stage makes the logits with the embedding
    matrix, so FLOPs and logits are the untied model's, and only the parameters differ."""
    report = estimate(_config("llama3_8b_fsdp8_est", ["--model.flavor", "3.2-1B"]), Hardware())
    rank = report["ranks"][0]
    assert report["num_params"] == report["params_over_all_shards"] == 1_235_814_400
    # 6 x all parameters (the tied matrix counted once as the output matmul) + 12 L H hd T attention.
    tokens = 2 * 8192
    assert rank["model_flops_per_microbatch"] / tokens == 6 * 1_235_814_400 + 12 * 16 * 32 * 64 * 8192
    assert rank["model_flops_per_microbatch"] / tokens == report["flops_per_token"]
    # Logits upcast to fp32 and their gradient: tokens x vocabulary x (2 + 8) bytes.
    assert rank["memory_bytes"]["logits"] == tokens * 128256 * 10
    assert rank["memory_bytes"]["params"] == 1_235_814_400 * 4 / 8  # fp32 master, evenly sharded



@pytest.mark.parametrize("args,message", [
    (["--comm.world_size", "500"], "not divisible"),
    (["--comm.world_size", "512", "--parallelism.tensor_parallel_degree", "16"], "tensor_parallel_degree 16"),
    (["--comm.world_size", "512", "--parallelism.pipeline_parallel_degree", "64",
      "--parallelism.pipeline_parallel_schedule", "Interleaved1F1B"], "cannot fill 128 pipeline stages"),
    (["--comm.world_size", "0"], "comm.world_size"),
    (["--comm.world_size", "512", "--estimate.mfu", "fast"], "estimate.mfu"),
])
def test_impossible_layout_fails_with_one_line(args, message, capsys, tmp_path):
    code = main(["--config", f"{CONFIGS}/llama3_405b.toml", "--job.dump_folder", str(tmp_path / "out"), *args])
    err = capsys.readouterr().err
    assert code == 2
    assert err.count("\n") == 1 and err.startswith("error:") and message in err
    assert not (tmp_path / "out").exists()


def test_405b_on_512_fake_ranks_under_a_minute(tmp_path):
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    t0 = time.perf_counter()
    proc = run_module("titan.estimate", ["--config", f"{CONFIGS}/llama3_405b_3d_est.toml", "--job.dump_folder",
                                         str(tmp_path)], env, timeout=120)
    elapsed = time.perf_counter() - t0
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert elapsed < 60
    report = json.loads((tmp_path / "estimate.json").read_text())
    assert report["layout"] | {"world_size": 512, "pp": 8, "tp": 8, "dp_shard": 8} == report["layout"]
    assert report["params_over_all_shards"] == report["num_params"]
    first, last = report["ranks"][0], report["ranks"][-1]
    assert [len(first["layers"][0]), len(last["layers"][0])] == [15, 15]
    assert {c["group"] for c in first["collectives"]} == {"tp", "pp", "fsdp"}
    assert "tokens/s/GPU" in proc.stdout
    *_, line = proc.stdout.strip().splitlines()
    peak = max(r["memory_gib"] for r in report["ranks"])
    assert line.startswith("done: dry run of llama3/405B on 512 ranks in ") and f"peak {peak:.1f} GiB" in line, line
    assert line.endswith(f"outputs in {tmp_path / 'estimate.json'}"), line


def test_deepseek_v3_671b_on_512_fake_ranks_with_expert_parallel_64():
    t0 = time.perf_counter()
    report = estimate(_config("deepseek_v3_671b_ep64_est"), Hardware())
    assert time.perf_counter() - t0 < 60
    assert report["layout"] | {"world_size": 512, "dp_shard": 512, "ep": 64} == report["layout"]
    # transformers' DeepseekV3ForCausalLM count (tests/titan/models/deepseek_v3/test_model.py), over the shards.
    assert report["params_over_all_shards"] == report["num_params"] == 671_026_404_352
    rank = report["ranks"][0]
    # Each expert group of 64 ranks splits a layer's 256 experts 4 a rank, which FSDP splits by rows over the 8
    # groups (half an expert each), as it splits the rest 512 ways: every rank stores 1/512 of the model (rank 0
    # the larger shard of an uneven split).
    assert rank["memory_bytes"]["params"] == pytest.approx(4 * report["num_params"] / 512, rel=1e-3)
    assert {c["group"] for c in rank["collectives"]} == {"ep", "fsdp", "efsdp"}
    # 8 GPUs a node: 7 of a rank's 63 peers in the expert group share its node.
    a2a = rank["all_to_all_bytes"]
    assert a2a["inter_node"] == pytest.approx(a2a["intra_node"] * 56 / 7)


def test_qwen3_32b_on_64_fake_ranks(tmp_path):
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = run_module("titan.estimate", ["--config", f"{CONFIGS}/qwen3_32b_fsdp8_tp8_est.toml", "--job.dump_folder",
                                         str(tmp_path)], env, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads((tmp_path / "estimate.json").read_text())
    assert report["layout"] | {"world_size": 64, "tp": 8, "dp_shard": 8} == report["layout"]
    # Qwen3ForCausalLM's count (tests/titan/models/qwen3/test_flavors.py), QK-norms included, over the 64 shards.
    assert report["params_over_all_shards"] == report["num_params"] == 32_762_123_264
    assert {c["group"] for c in report["ranks"][0]["collectives"]} == {"tp", "fsdp"}


def _fsdp_rows(world, *extra):
    cfg = parse_args(["--comm.world_size", str(world), "--model.n_layers", "2", "--float8.enable", *extra])
    return [c for c in estimate(cfg, Hardware())["ranks"][0]["collectives"] if c["group"] == "fsdp"]


def test_float8_all_gather_traffic_is_the_measured_one():
    """Per step as metrics.comm_stats counted it on 2 gloo ranks (tests/titan/quantization/test_float8.py, debug
    model, 2 blocks): float8 weights gather one byte an element instead of bf16's two, their scales from one amax
    all-reduce per step for all 14 weights."""
    plain, fp8 = _fsdp_rows(2), _fsdp_rows(2, "--float8.enable_fsdp_float8_all_gather", "true")
    gathered = {name: [c["calls"] * c["bytes_per_call"] for c in rows if c["op"] == "all_gather"][0]
                for name, rows in (("plain", plain), ("fp8", fp8))}
    float8_elems_per_block = 2 * 256 * 256 + 2 * 256 * 64 + 3 * 256 * 704  # wq wo, wk wv, w1 w2 w3
    assert gathered["plain"] - gathered["fp8"] == pytest.approx(float8_elems_per_block * 3)
    assert [(c["calls"], c["bytes_per_call"]) for c in fp8 if c["op"] == "all_reduce"] == [(1, 14 * 4)]
    assert not [c for c in plain if c["op"] == "all_reduce"]
    # Under tensor parallel the scale's amax is also reduced over the TP group.
    tp = _fsdp_rows(4, "--float8.enable_fsdp_float8_all_gather", "true", "--parallelism.tensor_parallel_degree", "2")
    assert [(c["group_size"], c["calls"]) for c in tp if c["op"] == "all_reduce"] == [(2, 1), (2, 1)]
