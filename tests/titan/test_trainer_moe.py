"""MoE families in the real trainer: expert parallel over 2 ranks, expert x tensor parallel over 2 and 4, pipeline
parallel and context parallel (each alone, with expert parallel, and with each other over 4 ranks) and compiled
blocks give the one-process eager losses and gradient norms (fp32, 1e-5), Qwen3-MoE's per-layer balance loss too with
MoE layers on both pipeline stages and DeepSeek-V3's sequence-wise balance loss in every layout, metrics.jsonl
carries the experts' load of every layer whichever stage holds it (worst layer and summed over the layers), and
expert parallel on a model without experts is one error line."""

import pytest

from tests.titan.conftest import TINY, assert_same_run, read_metrics, run_train

# DeepSeek-V3 with a strong sequence-wise balance loss in every layout: a wrong scale or grouping shows.
MOE_MODELS = {"qwen3_moe": ["--model.name", "qwen3_moe"],
              "deepseek_v3": ["--model.name", "deepseek_v3", "--model.seq_aux_loss_alpha", "0.5"]}
STEPS = ["--training.steps", "3", "--training.global_batch_size", "4"]


@pytest.mark.parametrize("model", MOE_MODELS)
def test_expert_parallel_2_matches_one_process(tmp_path, model):
    run_train([*TINY, *MOE_MODELS[model], *STEPS, "--job.dump_folder", str(tmp_path / "one")])
    run_train([*TINY, *MOE_MODELS[model], *STEPS, "--parallelism.expert_parallel_degree", "2",
               "--job.dump_folder", str(tmp_path / "ep2")], nproc=2)
    reference, records = read_metrics(tmp_path / "one"), read_metrics(tmp_path / "ep2")
    assert_same_run(records, reference)
    for got, want in zip(records, reference):
        # 2 x 32 tokens a sequence x k routed copies, counted over both ranks as in one process.
        assert got["moe_tokens_max"] == want["moe_tokens_max"] and got["moe_tokens_min"] == want["moe_tokens_min"]
        assert 1 <= got["moe_imbalance"] == pytest.approx(want["moe_imbalance"])
        assert 1 <= got["moe_imbalance_all_layers"] == pytest.approx(want["moe_imbalance_all_layers"])


# The expert group holds the TP ranks: each TP rank routes its sequence shard and dispatches it to experts no other
# TP rank repeats. Qwen3-MoE without the balance loss, which each TP rank takes over its shard; DeepSeek-V3 with its
# sequence-wise loss, which counts each sequence over the TP (and CP) ranks holding its shards.
@pytest.mark.parametrize("model, nproc, layout", [
    ("deepseek_v3", 2, ["--parallelism.expert_parallel_degree", "2"]),
    ("qwen3_moe", 4, ["--parallelism.expert_parallel_degree", "4"]),
    ("deepseek_v3", 4, ["--parallelism.expert_parallel_degree", "4", "--parallelism.context_parallel_degree", "2"]),
], ids=["deepseek_v3-ep2xtp2", "qwen3_moe-ep4xtp2xfsdp2", "deepseek_v3-ep4xcp2xtp2"])
def test_expert_x_tensor_parallel_matches_one_process(tmp_path, model, nproc, layout):
    """EP x TP with loss parallel, from a meta model as every run; on 4 ranks the experts (2 of 8 a rank) have no
    rank outside their expert group, which is the TP ranks alone on 2, and all of CP x TP with CP 2."""
    args = [*TINY, *MOE_MODELS[model], *(["--model.aux_loss_coef", "0"] if model == "qwen3_moe" else []), *STEPS]
    run_train([*args, "--job.dump_folder", str(tmp_path / "one")])
    run_train([*args, *layout, "--parallelism.tensor_parallel_degree", "2",
               "--job.dump_folder", str(tmp_path / "eptp")], nproc=nproc)
    reference, records = read_metrics(tmp_path / "one"), read_metrics(tmp_path / "eptp")
    assert_same_run(records, reference)
    for got, want in zip(records, reference):
        assert got["moe_tokens_max"] == want["moe_tokens_max"] and got["moe_tokens_min"] == want["moe_tokens_min"]


def test_expert_parallel_without_experts_is_one_error_line(tmp_path):
    proc = run_train([*TINY, "--parallelism.expert_parallel_degree", "2", "--job.dump_folder", str(tmp_path)],
                     nproc=2, check=False)
    assert proc.returncode != 0
    assert "error: parallelism.expert_parallel_degree 2 needs a model with experts" in proc.stderr


# A strong balance loss (Qwen3-MoE) and bias step (DeepSeek-V3), so that a wrong scale or update shows; DeepSeek-V3's
# two dense blocks fill the first stage of a 1F1B pipeline, which then holds no MoE layer.
PP_MODELS = {"qwen3_moe": [*MOE_MODELS["qwen3_moe"], "--model.aux_loss_coef", "0.5"],
             "deepseek_v3": [*MOE_MODELS["deepseek_v3"], "--model.n_dense_layers", "2",
                             "--model.bias_update_rate", "0.01"]}
# Each pipeline stage takes the balance loss over its own layers (MoEArgs.aux_loss_coef): Qwen3-MoE's two MoE layers,
# 1 and 2 of 5, share a stage in both splits (0-2 | 3-4 and 0 | 1-2 | 3 | 4), where it is the loss of all layers.
# The per-layer loss is a sum over layers, exact however the layers are split: MoE layers 1-3 of 4 on both stages.
PP_RUNS = {"qwen3_moe": [*PP_MODELS["qwen3_moe"], *STEPS, "--model.n_layers", "5", "--model.mlp_only_layers", "0,3,4"],
           "qwen3_moe_per_layer": [*PP_MODELS["qwen3_moe"], *STEPS, "--model.n_layers", "4",
                                   "--model.mlp_only_layers", "0", "--model.balance_loss", "per_layer"],
           "deepseek_v3": [*PP_MODELS["deepseek_v3"], *STEPS, "--model.n_layers", "4"]}


@pytest.fixture(scope="module")
def one_sequence_batches(module_tmp_path):
    """The one-process runs: 4 accumulation steps of one sequence, the micro-batches of the pipeline runs (the
    balance loss is one of each forward batch, so the split matters)."""
    runs = {}
    for model, args in PP_RUNS.items():
        folder = module_tmp_path / f"{model}_one"
        run_train([*TINY, *args, "--training.local_batch_size", "1", "--job.dump_folder", str(folder)])
        runs[model] = read_metrics(folder)
    return runs


PP2 = ["--parallelism.pipeline_parallel_degree", "2"]
EP2 = ["--parallelism.expert_parallel_degree", "2"]


@pytest.mark.parametrize("model, nproc, layout", [
    ("qwen3_moe", 2, [*PP2, "--parallelism.pipeline_parallel_schedule", "1F1B"]),
    ("qwen3_moe_per_layer", 2, [*PP2, "--parallelism.pipeline_parallel_schedule", "1F1B"]),
    ("deepseek_v3", 2, [*PP2, "--parallelism.pipeline_parallel_schedule", "Interleaved1F1B"]),
    ("qwen3_moe", 4, [*PP2, *EP2, "--parallelism.pipeline_parallel_schedule", "Interleaved1F1B"]),
    ("deepseek_v3", 4, [*PP2, *EP2, "--parallelism.pipeline_parallel_schedule", "1F1B"]),
    pytest.param("qwen3_moe", 2, [*PP2, "--parallelism.pipeline_parallel_schedule", "GPipe"], marks=pytest.mark.slow),
    pytest.param("deepseek_v3", 2, [*PP2, "--parallelism.pipeline_parallel_schedule", "1F1B"],
                 marks=pytest.mark.slow),
], ids=["qwen3_moe-pp2-1f1b", "qwen3_moe-per-layer-pp2-1f1b", "deepseek_v3-pp2-interleaved",
        "qwen3_moe-pp2xep2-interleaved", "deepseek_v3-pp2xep2-1f1b", "qwen3_moe-pp2-gpipe", "deepseek_v3-pp2-1f1b"])
def test_pipeline_parallel_matches_one_process(tmp_path, one_sequence_batches, model, nproc, layout):
    # Local batch 2 in micro-batches of one sequence, over 4 // (nproc // 2) accumulation steps.
    run_train([*TINY, *PP_RUNS[model], *layout, "--job.dump_folder", str(tmp_path)], nproc=nproc)
    assert_same_load(read_metrics(tmp_path), one_sequence_batches[model])


def assert_same_load(records, reference):
    assert_same_run(records, reference)
    for got, want in zip(records, reference):
        # Summed over micro-batches and data-parallel ranks, min and max over every stage's layers; the experts'
        # counts summed over all stages' layers.
        assert (got["moe_tokens_min"], got["moe_tokens_max"]) == (want["moe_tokens_min"], want["moe_tokens_max"])
        assert got["moe_imbalance"] == pytest.approx(want["moe_imbalance"])
        assert 1 <= got["moe_imbalance_all_layers"] == pytest.approx(want["moe_imbalance_all_layers"])


# Context parallel: the balance loss counts each whole sequence over the cp ranks; DeepSeek-V3's MLA (qk head dim
# 48, v head dim 32) with YaRN, whose rope table is sharded like the dense decoder's.
CP_MODELS = {"qwen3_moe": PP_MODELS["qwen3_moe"],
             "deepseek_v3": [*PP_MODELS["deepseek_v3"], "--model.n_dense_layers", "1", "--model.rope_factor", "4",
                             "--model.rope_original_max_seq_len", "16", "--model.rope_mscale", "1",
                             "--model.rope_mscale_all_dim", "1"],
             # Each layer's expert counts [L, E] summed over the cp ranks, where the all-layer loss sums an [E].
             "qwen3_moe_per_layer": [*PP_MODELS["qwen3_moe"], "--model.balance_loss", "per_layer"]}
CP2 = ["--parallelism.context_parallel_degree", "2"]


@pytest.mark.parametrize("model", CP_MODELS)
def test_context_parallel_matches_one_process(tmp_path, model):
    args = [*TINY, *CP_MODELS[model], "--training.steps", "3", "--training.global_batch_size", "2"]
    run_train([*args, "--job.dump_folder", str(tmp_path / "one")])
    reference = read_metrics(tmp_path / "one")
    # Expert parallel borrows the cp ranks: each holds half of the experts and a half of every sequence.
    for name, layout in {"cp2": CP2, "cp2xep2": [*CP2, *EP2]}.items():
        run_train([*args, *layout, "--job.dump_folder", str(tmp_path / name)], nproc=2)
        assert_same_load(read_metrics(tmp_path / name), reference)


# Pipeline x context parallel on 4 ranks: each stage's MoE layers route micro-batches whose sequences are split
# over the cp ranks. Qwen3-MoE without the balance loss, which each stage takes per micro-batch (not the one-process
# batch's); DeepSeek-V3 (a dense first stage, MLA with YaRN) also with expert parallel borrowing the cp ranks.
PP_CP_RUNS = {"qwen3_moe": ({"pp2xcp2": [*PP2, *CP2]}, [*MOE_MODELS["qwen3_moe"], "--model.aux_loss_coef", "0"]),
              "deepseek_v3": ({"pp2xcp2": [*PP2, *CP2], "pp2xcp2xep2": [*PP2, *CP2, *EP2]}, CP_MODELS["deepseek_v3"])}


@pytest.mark.parametrize("model", ["qwen3_moe", pytest.param("deepseek_v3", marks=pytest.mark.slow)])
def test_pipeline_x_context_parallel_matches_one_process(tmp_path, model):
    layouts, model_args = PP_CP_RUNS[model]
    args = [*TINY, *model_args, *STEPS]
    run_train([*args, "--job.dump_folder", str(tmp_path / "one")])
    reference = read_metrics(tmp_path / "one")
    for name, layout in layouts.items():
        run_train([*args, *layout, "--job.dump_folder", str(tmp_path / name)], nproc=4)
        assert_same_load(read_metrics(tmp_path / name), reference)


COMPILED = ["--compile.enable", "--compile.components", "model"]


# DeepSeek-V3 (MLA, dense and MoE blocks: two graphs) runs with -m slow: a minute more of tracing.
@pytest.mark.parametrize("model", ["qwen3_moe", pytest.param("deepseek_v3", marks=pytest.mark.slow)])
def test_compiled_blocks_have_no_graph_break_and_train_like_eager(tmp_path, model):
    """Each block is one graph (fullgraph): the expert counts, the per-expert split sizes of the fp32 path, the
    expert-parallel all-to-all and, under activation checkpointing, the load count are all traced. aot_eager
    (dynamo and AOT autograd, no code generation) keeps this fast; inductor is the slow test below."""
    args = [*TINY, *CP_MODELS[model], "--training.steps", "3", "--training.global_batch_size", "4"]
    run_train([*args, "--job.dump_folder", str(tmp_path / "eager")])
    reference = read_metrics(tmp_path / "eager")
    run_train([*args, *COMPILED, "--compile.backend", "aot_eager", "--job.dump_folder", str(tmp_path / "one")])
    assert_same_load(read_metrics(tmp_path / "one"), reference)
    run_train([*args, *COMPILED, "--compile.backend", "aot_eager", *EP2, "--activation_checkpoint.mode", "full",
               "--job.dump_folder", str(tmp_path / "ep2")], nproc=2)
    assert_same_load(read_metrics(tmp_path / "ep2"), reference)


@pytest.mark.slow
def test_inductor_compiled_blocks_train_like_eager(tmp_path):
    """Minutes on 2 loaded cores: inductor generates the MoE block's forward and backward on the CPU."""
    args = [*TINY, *PP_MODELS["qwen3_moe"], "--training.steps", "3", "--training.global_batch_size", "4"]
    run_train([*args, "--job.dump_folder", str(tmp_path / "eager")], timeout=600)
    run_train([*args, *COMPILED, "--job.dump_folder", str(tmp_path / "inductor")], timeout=900)
    assert_same_load(read_metrics(tmp_path / "inductor"), read_metrics(tmp_path / "eager"))
