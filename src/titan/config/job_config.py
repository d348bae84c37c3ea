"""One typed dataclass per config section. Key names follow TorchTitan's classic TOML names.

Every field carries a one-line docstring (shown by `--help`); `__post_init__` validates what can be
checked without knowing the world size or the model.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from titan.config.checks import non_negative, positive
from titan.config.model_section import Model


@dataclass
class Job:
    name: str = "debug"
    """Job name; the default dump folder is ./outputs/<name>."""
    dump_folder: str = ""
    """Folder for metrics, tensorboard and checkpoints (empty = ./outputs/<job.name>)."""
    description: str = ""
    """Free text saved with the run."""
    print_config: bool = False
    """Log the resolved config (as TOML) when the run starts."""
    overwrite: bool = False
    """Let a new run (nothing to resume) remove another run's metrics.jsonl and tensorboard files in dump_folder;
    without it such a run stops before writing anything."""

    def __post_init__(self) -> None:
        if not self.name or "/" in self.name:
            raise ValueError(f"job.name must be a non-empty name without '/', got {self.name!r}")


@dataclass
class Training:
    steps: int = 300
    """Number of optimizer steps."""
    local_batch_size: int = 8
    """Sequences per data-parallel rank per micro step."""
    global_batch_size: int = -1
    """Sequences per optimizer step over all ranks (-1 = local x dp degree; larger = gradient accumulation)."""
    seq_len: int = 256
    """Tokens per sequence."""
    max_norm: float = 1.0
    """Gradient clipping by global norm (0 = off)."""
    dataset: str = "wiki_offline"
    """wiki_offline (bundled Wikipedia leads), a hub dataset name (online only), or a name for dataset_path."""
    dataset_path: str = ""
    """Local file or folder of .json/.jsonl/.parquet/.txt documents (overrides the bundled corpus)."""
    text_field: str = "text"
    """Field holding the document text in json/jsonl/parquet records."""
    validation_fraction: float = 0.01
    """Fraction of documents held out for validation."""
    mixed_precision_param: Literal["bfloat16", "float32", "float16"] = "bfloat16"
    """Compute dtype for parameters in forward/backward (master weights stay fp32)."""
    mixed_precision_reduce: Literal["float32", "bfloat16"] = "float32"
    """Dtype of gradient reduction across data-parallel ranks."""
    on_nonfinite: Literal["stop", "skip"] = "stop"
    """On a NaN/Inf loss or grad norm: stop with an error, or skip that update."""
    max_consecutive_skips: int = 5
    """With on_nonfinite = skip: stop after this many non-finite steps in a row."""

    def __post_init__(self) -> None:
        positive("training", steps=self.steps, local_batch_size=self.local_batch_size, seq_len=self.seq_len)
        non_negative("training", max_norm=self.max_norm)
        positive("training", max_consecutive_skips=self.max_consecutive_skips)
        if self.global_batch_size == 0 or self.global_batch_size < -1:
            raise ValueError(f"training.global_batch_size must be > 0 or -1, got {self.global_batch_size}")
        if not 0.0 <= self.validation_fraction < 1.0:
            raise ValueError(f"training.validation_fraction must be in [0, 1), got {self.validation_fraction}")


@dataclass
class Optimizer:
    name: Literal["AdamW", "Adam", "SGD"] = "AdamW"
    """Optimizer class."""
    lr: float = 8e-4
    """Peak learning rate."""
    beta1: float = 0.9
    """Adam beta1 (first-moment decay); optimizer.betas = [beta1, beta2] sets both."""
    beta2: float = 0.95
    """Adam beta2 (second-moment decay)."""
    eps: float = 1e-8
    """Adam epsilon."""
    weight_decay: float = 0.1
    """Decoupled weight decay."""
    momentum: float = 0.9
    """SGD momentum."""
    implementation: Literal["foreach", "fused", "for-loop"] = "fused"
    """Kernel style of the optimizer step."""

    def __post_init__(self) -> None:
        positive("optimizer", lr=self.lr, eps=self.eps)
        non_negative("optimizer", weight_decay=self.weight_decay)
        for key in ("beta1", "beta2"):
            if not 0 <= getattr(self, key) < 1:
                raise ValueError(f"optimizer.{key} must be in [0, 1), got {getattr(self, key)}")


@dataclass
class LRScheduler:
    warmup_steps: int = 20
    """Linear warmup steps from near zero to optimizer.lr."""
    decay_ratio: float = -1.0
    """Fraction of steps spent decaying at the end (-1 = decay over all steps after warmup)."""
    decay_type: Literal["linear", "cosine", "sqrt"] = "linear"
    """Shape of the decay."""
    min_lr_factor: float = 0.0
    """Final learning rate as a fraction of optimizer.lr."""
    total_steps: int = 0
    """Steps the schedule spans (0 = training.steps), e.g. to keep a long run's schedule in a short test."""

    def __post_init__(self) -> None:
        non_negative("lr_scheduler", warmup_steps=self.warmup_steps, total_steps=self.total_steps)
        if not (self.decay_ratio == -1.0 or 0.0 <= self.decay_ratio <= 1.0):
            raise ValueError(f"lr_scheduler.decay_ratio must be in [0, 1] or -1, got {self.decay_ratio}")
        if not 0.0 <= self.min_lr_factor <= 1.0:
            raise ValueError(f"lr_scheduler.min_lr_factor must be in [0, 1], got {self.min_lr_factor}")


@dataclass
class Parallelism:
    data_parallel_replicate_degree: int = 1
    """HSDP/DDP replica groups."""
    data_parallel_shard_degree: int = -1
    """FSDP shard degree (-1 = the rest of the world size)."""
    fsdp_reshard_after_forward: Literal["default", "always", "never"] = "default"
    """Free gathered parameters after forward (default: yes, except with pipeline parallel)."""
    tensor_parallel_degree: int = 1
    """Tensor (and sequence) parallel degree."""
    pipeline_parallel_degree: int = 1
    """Pipeline stages over ranks."""
    pipeline_parallel_schedule: Literal[
        "GPipe", "1F1B", "Interleaved1F1B", "LoopedBFS", "InterleavedZeroBubble", "ZBVZeroBubble", "DualPipeV"
    ] = "1F1B"
    """Pipeline schedule."""
    pipeline_parallel_microbatch_size: int = 1
    """Sequences per pipeline microbatch."""
    pipeline_parallel_layers_per_stage: int = 0
    """Layers per pipeline stage (0 = split evenly; the last stage takes what is left)."""
    pipeline_parallel_split_points: list[str] = field(default_factory=list)
    """Explicit stage boundaries as module names, e.g. ["layers.4", "layers.8"] (overrides layers_per_stage)."""
    context_parallel_degree: int = 1
    """Context (sequence) parallel degree for attention."""
    expert_parallel_degree: int = 1
    """Expert parallel degree for MoE models: each layer's routed experts split over this many ranks, borrowed
    from data_parallel_shard_degree x context_parallel_degree x tensor_parallel_degree (a multiple of cp x tp that
    divides the product; TorchTitan's expert_tensor_parallel_degree 1)."""
    enable_loss_parallel: bool = True
    """With TP: compute the loss on vocabulary-sharded logits."""
    enable_async_tensor_parallel: bool = False
    """With TP on CUDA: overlap TP collectives with matmuls (compiler micro-pipelining; needs compile.enable)."""

    def __post_init__(self) -> None:
        positive(
            "parallelism",
            data_parallel_replicate_degree=self.data_parallel_replicate_degree,
            tensor_parallel_degree=self.tensor_parallel_degree,
            pipeline_parallel_degree=self.pipeline_parallel_degree,
            context_parallel_degree=self.context_parallel_degree,
            expert_parallel_degree=self.expert_parallel_degree,
            pipeline_parallel_microbatch_size=self.pipeline_parallel_microbatch_size,
        )
        non_negative("parallelism", pipeline_parallel_layers_per_stage=self.pipeline_parallel_layers_per_stage)
        for point in self.pipeline_parallel_split_points:
            if not (point.startswith("layers.") and point[7:].isdigit()):
                raise ValueError(f"parallelism.pipeline_parallel_split_points: {point!r} is not a block name like "
                                 "'layers.4'")
        if self.data_parallel_shard_degree == 0 or self.data_parallel_shard_degree < -1:
            raise ValueError(
                f"parallelism.data_parallel_shard_degree must be > 0 or -1 (the rest), "
                f"got {self.data_parallel_shard_degree}"
            )


@dataclass
class Checkpoint:
    enable: bool = False
    """Save checkpoints and resume from the latest complete one."""
    folder: str = "checkpoint"
    """Checkpoint folder, relative to job.dump_folder."""
    interval: int = 500
    """Save every N steps (and at the last step)."""
    keep_latest_k: int = 10
    """Keep only the newest K checkpoints (0 = keep all)."""
    save_on_signal: bool = True
    """On SIGINT/SIGTERM (Ctrl-C, a preempted job) finish the step and save it before exiting."""
    async_mode: Literal["disabled", "async"] = "disabled"
    """Save in the background while training continues."""
    reuse_staging_buffer: bool = True
    """Async saves copy the state into one host buffer kept between saves (pinned on CUDA) instead of a new one per
    save: staging is several times faster, and this rank's share of the state stays allocated in host memory."""
    load_step: int = -1
    """Resume from this step instead of the latest (-1 = latest)."""
    exclude_from_loading: list[str] = field(default_factory=list)
    """State keys not to load on resume, e.g. ["optimizer", "lr_scheduler", "dataloader"]."""
    initial_load_path: str = ""
    """Weights to start from when the checkpoint folder holds no checkpoint: a DCP step folder (titan's or
    TorchTitan's; model weights only, the run starts at step 0) or, with initial_load_in_hf, a Hugging Face folder."""
    initial_load_in_hf: bool = False
    """checkpoint.initial_load_path is in Hugging Face format (config.json + safetensors), not DCP."""
    create_seed_checkpoint: bool = False
    """Write the initial weights as step 0 and exit (one process), so every layout starts from them."""
    last_save_model_only: bool = False
    """The final checkpoint holds only the model weights (an export), in export_dtype."""
    export_dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    """Dtype of model-only checkpoints."""

    def __post_init__(self) -> None:
        positive("checkpoint", interval=self.interval)
        non_negative("checkpoint", keep_latest_k=self.keep_latest_k)
        if self.load_step < -1:
            raise ValueError(f"checkpoint.load_step must be >= 0 or -1 (latest), got {self.load_step}")
        allowed = {"model", "optimizer", "lr_scheduler", "dataloader", "train_state"}
        unknown = set(self.exclude_from_loading) - allowed
        if unknown:
            raise ValueError(f"checkpoint.exclude_from_loading: unknown {sorted(unknown)}; allowed {sorted(allowed)}")


@dataclass
class Metrics:
    log_freq: int = 10
    """Log every N steps (and the first and last)."""
    enable_tensorboard: bool = True
    """Write tensorboard event files under <dump_folder>/<save_tb_folder>."""
    save_tb_folder: str = "tb"
    """Tensorboard folder, relative to job.dump_folder."""
    enable_wandb: bool = False
    """Log the same scalars to Weights & Biases (pip install wandb; WANDB_MODE=offline writes locally)."""
    enable_jsonl: bool = True
    """Write <dump_folder>/metrics.jsonl."""
    cpu_peak_tflops: float = 0.0
    """Peak TFLOP/s used for MFU on a CPU (0 = measure a matmul in training.mixed_precision_param, cached)."""
    comm_stats: bool = False
    """Count each step's collectives and log their payload bytes per kind:group as comm_bytes (slows steps)."""

    def __post_init__(self) -> None:
        positive("metrics", log_freq=self.log_freq)
        if not self.save_tb_folder:
            raise ValueError("metrics.save_tb_folder must name a folder under job.dump_folder, got ''")
        non_negative("metrics", cpu_peak_tflops=self.cpu_peak_tflops)


@dataclass
class Profiling:
    enable_profiling: bool = False
    """Write a torch.profiler chrome trace of every profile_freq-th step (open in Perfetto or chrome://tracing)."""
    save_traces_folder: str = "profile_traces"
    """Trace folder, relative to job.dump_folder: iteration_<step>/rank<r>_trace.json."""
    profile_freq: int = 10
    """Profile every N-th step (after a few warm-up steps)."""
    enable_memory_snapshot: bool = False
    """CUDA: allocator history snapshots every profile_freq steps and on OOM; CPU: per-step RSS and op memory."""
    save_memory_snapshot_folder: str = "memory_snapshot"
    """Memory snapshot folder, relative to job.dump_folder."""

    def __post_init__(self) -> None:
        positive("profiling", profile_freq=self.profile_freq)
        for key in ("save_traces_folder", "save_memory_snapshot_folder"):
            if not getattr(self, key):
                raise ValueError(f"profiling.{key} must name a folder under job.dump_folder, got ''")


@dataclass
class Validation:
    enable: bool = False
    """Evaluate the loss on held-out data periodically."""
    freq: int = 100
    """Validate every N steps (and at the end)."""
    steps: int = 10
    """Batches per validation (-1 = the whole validation split)."""

    def __post_init__(self) -> None:
        positive("validation", freq=self.freq)
        if self.steps == 0 or self.steps < -1:
            raise ValueError(f"validation.steps must be > 0 or -1, got {self.steps}")


@dataclass
class ActivationCheckpoint:
    mode: Literal["none", "full", "selective"] = "none"
    """Recompute activations in backward: none, full (whole blocks), selective (see selective_ac_option)."""
    selective_ac_option: str = "2"
    """selective: 'op' (save matmul outputs, recompute the rest) or an integer N (every N-th block)."""

    def __post_init__(self) -> None:
        opt = self.selective_ac_option
        if opt != "op" and not (opt.isdigit() and int(opt) > 0):
            raise ValueError(
                f"activation_checkpoint.selective_ac_option must be 'op' or a positive integer, got {opt!r}"
            )


@dataclass
class Compile:
    enable: bool = False
    """torch.compile what compile.components names."""
    backend: str = "inductor"
    """torch.compile backend."""
    components: list[Literal["model", "loss"]] = field(default_factory=lambda: ["model", "loss"])
    """What to compile: model (each transformer block) and/or loss (the spec's loss function)."""

    def __post_init__(self) -> None:
        unknown = [c for c in self.components if c not in ("model", "loss")]
        if unknown or not self.components:
            raise ValueError(f"compile.components must name model and/or loss, got {self.components}")


@dataclass
class Float8:
    enable: bool = False
    """Train linear layers in float8."""
    recipe: Literal["tensorwise", "rowwise"] = "tensorwise"
    """Scaling granularity."""
    backend: Literal["auto", "torchao", "titan"] = "auto"
    """auto: torchao's Float8Linear where its float8 kernels run (CUDA sm89+, sm90+ for rowwise; the `float8`
    extra installs it), else titan's own (exact emulation on a CPU). torchao off those GPUs runs emulated."""
    enable_fsdp_float8_all_gather: bool = False
    """With FSDP: all-gather float8 linear weights in float8 (half of bf16's bytes); tensorwise recipe only."""
    filter_fqns: list[str] = field(default_factory=lambda: ["output"])
    """Linear layers kept in high precision: those whose name contains one of these."""

    def __post_init__(self) -> None:
        if self.enable_fsdp_float8_all_gather and not self.enable:
            raise ValueError("float8.enable_fsdp_float8_all_gather needs --float8.enable")
        if self.enable_fsdp_float8_all_gather and self.recipe != "tensorwise":
            raise ValueError("float8.enable_fsdp_float8_all_gather needs float8.recipe = 'tensorwise' (a rowwise "
                             "weight is scaled per row of each matmul, not once for the all-gather)")


@dataclass
class Comm:
    mode: Literal["default", "fake"] = "default"
    """default: real process groups; fake: a fake backend for dry runs at any world size."""
    world_size: int = 0
    """World size for comm.mode = fake (0 = from the environment)."""
    init_timeout_seconds: int = 300
    """Timeout of process-group creation and the first step's collectives."""
    train_timeout_seconds: int = 100
    """Collective timeout after the first step."""
    trace_buf_size: int = 20000
    """NCCL flight recorder: collectives kept per rank, dumped to <dump_folder>/comm_traces on a timeout (0 = off)."""

    def __post_init__(self) -> None:
        non_negative("comm", world_size=self.world_size, trace_buf_size=self.trace_buf_size)
        positive("comm", init_timeout_seconds=self.init_timeout_seconds,
                  train_timeout_seconds=self.train_timeout_seconds)


@dataclass
class Debug:
    seed: int = 0
    """Random seed for weights, data order and dropout."""
    deterministic: bool = False
    """Use deterministic algorithms (slower) so reruns match bit for bit."""
    threads: int = 0
    """torch intra-op threads per process (0 = cores / local processes)."""
    full_init: bool = True
    """Initialize the whole model on rank 0's CPU and broadcast it, so every layout starts from the weights one
    process would use (skipped above 2B parameters: use a seed checkpoint there)."""
    distributed_debug: Literal["off", "info", "detail"] = "off"
    """TORCH_DISTRIBUTED_DEBUG for the process groups: detail checks that ranks call matching collectives."""
    detect_anomaly: bool = False
    """Autograd anomaly detection: name the backward op that produced a NaN (slows every step)."""
    memory_check: bool = True
    """Refuse, before it starts, a run whose estimated peak memory per rank exceeds this machine's."""

    def __post_init__(self) -> None:
        non_negative("debug", seed=self.seed, threads=self.threads)


@dataclass
class JobConfig:
    job: Job = field(default_factory=Job)
    model: Model = field(default_factory=Model)
    training: Training = field(default_factory=Training)
    optimizer: Optimizer = field(default_factory=Optimizer)
    lr_scheduler: LRScheduler = field(default_factory=LRScheduler)
    parallelism: Parallelism = field(default_factory=Parallelism)
    checkpoint: Checkpoint = field(default_factory=Checkpoint)
    metrics: Metrics = field(default_factory=Metrics)
    profiling: Profiling = field(default_factory=Profiling)
    validation: Validation = field(default_factory=Validation)
    activation_checkpoint: ActivationCheckpoint = field(default_factory=ActivationCheckpoint)
    compile: Compile = field(default_factory=Compile)
    float8: Float8 = field(default_factory=Float8)
    comm: Comm = field(default_factory=Comm)
    debug: Debug = field(default_factory=Debug)

    @property
    def dump_folder(self) -> str:
        return self.job.dump_folder or f"./outputs/{self.job.name}"
