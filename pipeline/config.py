"""Typed run configs: YAML manifests load into these pydantic models; the CLI only overrides.

Every model forbids unknown keys, and every error is reported as ``section.field: problem``
with the fix (``ConfigError``). Overrides use dotted keys: ``data.max_samples=8``; the
value is parsed as YAML (``capture.layer_ids=[1,5,9]``, ``store.uri=null``). Loading, overrides and
the error messages live in ``pipeline/config_loading.py`` (re-exported here).
"""

from __future__ import annotations

import re
import unicodedata
from pathlib import Path
from typing import Annotated, Any, Literal, Union

from pydantic import (AfterValidator, BaseModel, ConfigDict, Field, SerializeAsAny, ValidationError, ValidationInfo,
                      field_validator, model_validator)
from pydantic_core import InitErrorDetails, PydanticCustomError

from specray.capture.chat import NAMED_TEMPLATES, check_chat_template, check_template_kwargs
from specray.capture.contract import CONTRACT_SPECS, STORAGE_DTYPES
from specray.capture.data import DATASETS, ROW_DATASETS
from specray.capture.devices import check_ray_devices
from specray.capture.target import DEFAULT_TARGET
from specray.drafters import DEFAULT_ALGORITHM, DRAFTERS, get_drafter
from specray.serving.http_guard import HttpLimits
from specray.serving.recorder import RecordSettings
from specray.trainer.assembly import TrainSpec, check_capture_fits
from specray.trainer.core import OptimSettings
from specray.trainer.strategies import get_strategy
from specray.trainer.tracking import TrackingSettings
from specray.pipeline.config_loading import ConfigError, apply_overrides, load_config  # noqa: F401 (re-exported)
from specray.pipeline.jobs.rundir import RUNS_ROOT


def _absolute(path_or_uri: str) -> str:
    """A local path made absolute; a URI (``s3://…``) as it is."""
    return path_or_uri if "://" in path_or_uri else str(Path(path_or_uri).resolve())


class Section(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)


_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")
MAX_NAME = 128
SUB_RUN_SUFFIX = {"offline": "-capture", "online": "-capture", "closed_loop": "-initial-capture"}
"""The longest suffix a pipeline of each mode appends to its name for a sub-run (``capture_job``; the closed
loop's offline and online pipelines, pipeline/jobs/closed_loop.py): the room a pipeline's name leaves."""


def _name_problem(value: str) -> str:
    """What makes ``value`` no run name (``_one_path_component``)."""
    control = [c for c in value if unicodedata.category(c).startswith("C")]
    if not value:
        return "is empty"
    if control:
        return f"contains the control character {control[0]!r}"
    if "/" in value or "\\" in value:
        return "contains a path separator"
    if len(value) > MAX_NAME:
        return f"is longer than {MAX_NAME} characters"
    if value[0] in ".-":
        return f"starts with {value[0]!r}"
    return "contains a character other than letters, digits, '.', '_' and '-'"


def _one_path_component(value: str) -> str:
    """A run name: one path component under ``runs/`` (pipeline/jobs/rundir.py)."""
    if _NAME.fullmatch(value) and len(value) <= MAX_NAME:
        return value
    raise ValueError(
        f"the run name {_name_problem(value)}; it names one directory, runs/<name>, and the run's Serve app, "
        f"manifest and ledger: use letters, digits, '.', '_' and '-', starting with a letter or digit, at most "
        f"{MAX_NAME} characters (e.g. name=quickstart-2)")


RunName = Annotated[str, AfterValidator(_one_path_component)]
"""A job's ``name``: validated as one path component (never empty, ``..``, ``a/b`` or a control character)."""


def _strict(info: ValidationInfo) -> bool:
    """Whether this validation runs strictly (``load_config``), so a section validated by hand runs so too."""
    return bool((info.context or {}).get("strict"))


class TargetConfig(Section):
    name: str = Field(DEFAULT_TARGET, description="embedded:<name>, debug[:seed], or a local HF model directory")
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field(
        "auto", description="compute dtype of the target: auto = bfloat16 on a GPU, float32 on the CPU (exact "
                            "against transformers); trainer ranks read the embedding and LM head in it under bf16 "
                            "training, else in float32")
    device: Literal["auto", "cpu", "cuda"] = Field(
        "auto", description="where the target runs (capture, serving): auto = CUDA where the process is granted a "
                            "GPU (a Ray capture actor: capture.num_gpus_per_actor), else the CPU; trainer ranks put "
                            "the target's heads on the training device instead")


def _chat_template_field() -> Any:
    return Field(None, description=f"render with this template instead of the tokenizer's: {sorted(NAMED_TEMPLATES)} "
                                   "or a Jinja file (None = the tokenizer's own; targets without one need it)")


def _chat_template_kwargs_field() -> Any:
    return Field(default_factory=dict, description="values the template reads, e.g. {enable_thinking: false}; "
                                                   "written into the template (its fingerprint covers them)")


class DataConfig(Section):
    dataset: str = Field("sharegpt", description="sharegpt, jsonl:PATH, parquet:PATH (a file or a directory of them), "
                                                 "hf:PATH (a datasets save_to_disk directory), or records:URI "
                                                 "(recorded served traffic; mtbench/humaneval are eval-only)")
    skip: int = Field(0, ge=0, description="skip the first N conversations (e.g. a held-out slice after a training slice)")
    max_samples: int | None = Field(None, gt=0, description="use at most this many conversations (None = all)")
    max_length: int = Field(2048, gt=0, description="maximum tokens per rendered sample")
    truncation: Literal["truncate", "drop"] = Field(
        "truncate", description="truncate: keep the first max_length tokens; drop: skip longer samples"
    )
    id_field: str | None = Field(None, min_length=1, description="jsonl/parquet/hf: the column holding each sample's "
                                                                "id, required in every row and unique (None = a "
                                                                "row's 'id' when it has one, else generated)")
    chat_template: str | None = _chat_template_field()
    chat_template_kwargs: dict[str, Any] = _chat_template_kwargs_field()

    @field_validator("dataset")
    @classmethod
    def _known_dataset(cls, value: str) -> str:
        for prefix, example in (("jsonl:", "jsonl:data/chats.jsonl"), ("parquet:", "parquet:data/chats.parquet"),
                                ("hf:", "hf:data/chats (a datasets save_to_disk directory)"),
                                ("records:", "records:s3://bucket/traffic (serve.record.uri)")):
            if value.startswith(prefix):
                if not value.removeprefix(prefix):
                    raise ValueError(f"{prefix} needs a location, e.g. {example}")
                return value
        if value not in DATASETS:
            raise ValueError(f"unknown dataset {value!r}; use one of {sorted(DATASETS)}, jsonl:PATH, parquet:PATH, "
                             "hf:PATH or records:URI")
        if DATASETS[value].split == "eval":
            raise ValueError(f"{value!r} is held out for evaluation; capture training data from sharegpt or jsonl:PATH")
        return value

    _known_template = field_validator("chat_template")(classmethod(lambda cls, value: check_chat_template(value)))
    _template_values = field_validator("chat_template_kwargs")(classmethod(lambda cls, value: check_template_kwargs(value)))

    @model_validator(mode="after")
    def _id_field_of_rows(self) -> "DataConfig":
        if self.id_field is not None and not self.dataset.startswith(ROW_DATASETS):
            raise ValueError(f"id_field={self.id_field!r} names a column of jsonl:, parquet: or hf: rows; dataset "
                             f"{self.dataset!r} has its own ids: remove data.id_field")
        return self


class CaptureConfig(Section):
    algorithm: str = Field("dflash", description=f"feature contract to capture: {sorted(CONTRACT_SPECS)}")
    layer_ids: list[int] | None = Field(
        None, description="decoder-layer output ids in concatenation order (None = the algorithm's default)"
    )
    dtype: str = Field("bfloat16", description=f"storage dtype of features: {sorted(STORAGE_DTYPES)}")
    max_batch_tokens: int = Field(8192, gt=0, description="padded tokens per forward (batch size x longest sample)")
    max_batch_size: int = Field(32, gt=0, description="samples per forward")

    @field_validator("algorithm")
    @classmethod
    def _known_algorithm(cls, value: str) -> str:
        if value not in CONTRACT_SPECS:
            raise ValueError(f"unknown algorithm {value!r}; use one of {sorted(CONTRACT_SPECS)}")
        return value

    @field_validator("dtype")
    @classmethod
    def _known_dtype(cls, value: str) -> str:
        if value not in STORAGE_DTYPES:
            raise ValueError(f"unknown storage dtype {value!r}; use one of {sorted(STORAGE_DTYPES)}")
        return value


class StoreConfig(Section):
    uri: str | None = Field(None, description="file://…, s3://bucket/prefix, or ray://NAME for online pipelines "
                                              "(None = <run_dir>/features)")
    endpoint_url: str | None = Field(None, description="S3 endpoint, e.g. http://127.0.0.1:8333 (else $SPECRAY_S3_ENDPOINT)")

    @field_validator("uri")
    @classmethod
    def _known_scheme(cls, value: str | None) -> str | None:
        if value is not None and "://" in value and not value.startswith(("file://", "s3://", "ray://")):
            raise ValueError(f"store URI {value!r}: use file://PATH, s3://BUCKET/PREFIX or (online) ray://NAME")
        return value


class OutputConfig(Section):
    run_dir: str | None = Field(None, description="where manifest and summary go (None = runs/<name>)")
    overwrite: bool = Field(False, description="replace an existing manifest of the same run (deletes its features)")


class JobConfig(Section):
    """A run: its ``name`` and an ``output`` section with an optional ``run_dir``."""

    @property
    def run_dir(self) -> Path:
        return Path(self.output.run_dir or RUNS_ROOT / self.name)


class CaptureJobConfig(JobConfig):
    """``specray capture``: render a dataset, capture features, write a manifest."""

    name: RunName = Field("capture", description="run name; the default run dir is runs/<name>")
    target: TargetConfig = TargetConfig()
    data: DataConfig = DataConfig()
    capture: CaptureConfig = CaptureConfig()
    store: StoreConfig = StoreConfig()
    output: OutputConfig = OutputConfig()

    @property
    def store_uri(self) -> str:
        return self.store.uri or (self.run_dir / "features").resolve().as_uri()


# -- specray train --------------------------------------------------------------------------


class TrainDataConfig(Section):
    manifest: str | None = Field(
        ..., description="Parquet manifest written by specray capture (runs/<name>/manifest.parquet); "
        "null = online: features stream from a SampleBroker (actors/trainer.py run_trainer_gang)",
    )
    endpoint_url: str | None = Field(None, description="S3 endpoint when the manifest or its store is on s3://")
    max_length: int | None = Field(None, gt=0, description="cut samples to this many tokens (None = as captured)")


DrafterSection = Annotated[Union[tuple(spec.section for spec in DRAFTERS.values())], Field(discriminator="algorithm")]
"""The manifest's ``drafter`` section: the registered drafters' sections (``drafters/<a>.py``),
discriminated by ``algorithm`` (default dflash)."""


def _drafter_section(cls, value: Any, info: ValidationInfo) -> Any:
    """Validate a ``drafter`` mapping as its algorithm's section; refuse an algorithm without a
    registered drafter and train strategy, naming the implemented ones."""
    if not isinstance(value, dict):
        return value  # a section already, or a type error pydantic reports
    value = {"algorithm": DEFAULT_ALGORITHM, **value}
    try:
        get_strategy(value["algorithm"])
    except ValueError as e:
        error = PydanticCustomError("algorithm_not_implemented", str(e).replace("{", "{{").replace("}", "}}"))
        raise ValidationError.from_exception_data(
            "drafter", [InitErrorDetails(type=error, loc=("algorithm",), input=value["algorithm"])]) from None
    return get_drafter(value["algorithm"]).section.model_validate(value, strict=_strict(info), context=info.context)


def _objective_section(cls, value: Any, info: ValidationInfo) -> Any:
    """Validate the ``objective`` section against the train strategy of the drafter's algorithm."""
    drafter = info.data.get("drafter")
    if drafter is None:  # the drafter section is invalid: its error is reported
        return value
    objective = get_strategy(drafter.algorithm).objective
    if isinstance(value, objective):
        return value
    return objective.model_validate(value, strict=_strict(info), context=info.context)


def _drafter_field() -> Any:
    return Field(default_factory=dict, validate_default=True,
                 description="the drafter to train: `algorithm` and that algorithm's fields (drafters/<algorithm>.py)")


def _objective_field() -> Any:
    return Field(default_factory=dict, validate_default=True,
                 description="the loss of the drafter's algorithm: its train strategy's fields "
                             "(trainer/strategies/<algorithm>.py)")


class OptimSection(Section):
    lr: float = Field(6e-4, gt=0)
    weight_decay: float = Field(0.0, ge=0)
    warmup_steps: int = Field(20, ge=0)
    total_steps: int = Field(200, gt=0, description="optimizer steps")
    min_lr_ratio: float = Field(0.1, ge=0, le=1, description="cosine floor as a fraction of lr")
    grad_clip: float | None = Field(1.0, gt=0, description="global grad-norm clip (None = off)")
    micro_batch_size: int = Field(2, gt=0, description="sequences per rank per micro-batch")
    accumulation_steps: int = Field(1, gt=0)
    seed: int = Field(0, description="seeds init, data order and anchors")


def _device_field() -> Any:
    return Field("auto", description="where a rank's drafter, batches and optimizer state live: auto = CUDA where "
                                     "the rank has a GPU, else the CPU; cuda without one is refused")


def _precision_field() -> Any:
    return Field("auto", description="the drafter's compute: bf16 (autocast, fp32 weights and optimizer state) or "
                                     "fp32; auto = bf16 on CUDA, fp32 on the CPU (the golden losses)")


class TrainerSection(Section):
    world_size: int = Field(1, gt=0, description="DDP ranks (torch.distributed: NCCL on CUDA, one GPU each; gloo on "
                                                 "the CPU) on this machine")
    device: Literal["auto", "cpu", "cuda"] = _device_field()
    precision: Literal["auto", "fp32", "bf16"] = _precision_field()
    log_every: int = Field(10, gt=0)
    checkpoint_every: int = Field(100, gt=0)
    keep_last: int | None = Field(2, gt=0, description="checkpoints kept (None = all)")


class LiveEvalSection(Section):
    """Live acceptance at each checkpoint (serving/live_eval.py): the drafter decodes held-out prompts
    greedily on the serving engine, verifying its largest round every round."""

    enabled: bool = Field(True, description="measure tau_live and live_accept_by_pos at every checkpoint (rank 0)")
    dataset: str = Field("mtbench", description="held-out prompts: mtbench, humaneval or jsonl:PATH (each record's "
                                                "turns before its first answer)")
    num_prompts: int = Field(16, gt=0, description="prompts decoded at each checkpoint")
    max_tokens: int = Field(32, gt=0, description="new tokens per prompt")
    num_speculative_tokens: int | None = Field(
        None, gt=0, description="drafts verified every round (None = the worker's largest, e.g. DFlash's block - 1)")
    batch_size: int = Field(4, gt=0, description="prompts decoded at once (bench serve at this batch size agrees)")

    @field_validator("dataset")
    @classmethod
    def _known_dataset(cls, value: str) -> str:
        if value not in ("mtbench", "humaneval") and not (value.startswith("jsonl:") and len(value) > 6):
            raise ValueError(f"unknown live_eval dataset {value!r}; use mtbench, humaneval or jsonl:PATH")
        return value

    def settings(self):
        """The plain settings a trainer rank gets (None when off)."""
        from specray.serving.live_eval import LiveEvalSettings

        if not self.enabled:
            return None
        return LiveEvalSettings(**self.model_dump(exclude={"enabled"}))


def _live_eval_field() -> Any:
    return Field(default_factory=LiveEvalSection,
                 description="live acceptance at each checkpoint: held-out prompts on the serving engine")


def _tracking_field() -> Any:
    return Field(default_factory=TrackingSettings,
                 description="experiment tracking: TensorBoard, W&B and MLflow, each off by default")


class TrainOutputSection(Section):
    run_dir: str | None = Field(None, description="checkpoints, metrics.jsonl, curves.png (None = runs/<name>)")
    resume: bool = Field(True, description="continue from the run dir's latest checkpoint if there is one")


class TrainJobConfig(JobConfig):
    """``specray train``: train a drafter on a captured manifest."""

    name: RunName = Field("train", description="run name; the default run dir is runs/<name>")
    target: TargetConfig = TargetConfig()
    data: TrainDataConfig
    drafter: DrafterSection = _drafter_field()
    objective: SerializeAsAny[BaseModel] = _objective_field()
    optim: OptimSection = OptimSection()
    trainer: TrainerSection = TrainerSection()
    live_eval: LiveEvalSection = _live_eval_field()
    tracking: TrackingSettings = _tracking_field()
    output: TrainOutputSection = TrainOutputSection()

    _drafter = field_validator("drafter", mode="before")(classmethod(_drafter_section))
    _objective = field_validator("objective", mode="before")(classmethod(_objective_section))

    def train_spec(self, *, device_field: str = "trainer.device") -> TrainSpec:
        """The run as ``trainer/assembly.py``'s plain spec, paths absolute (the gang's workers run elsewhere);
        ``device_field`` is the config field errors about the device name (a pipeline's is ``train.device``)."""
        o, t = self.optim, self.trainer
        return TrainSpec(
            name=self.name, run_dir=str(self.run_dir.resolve()), target=self.target.name,
            target_dtype=self.target.dtype, device=t.device, precision=t.precision,
            drafter=self.drafter, objective=self.objective,
            optim=OptimSettings(lr=o.lr, weight_decay=o.weight_decay, warmup_steps=o.warmup_steps,
                                total_steps=o.total_steps, min_lr_ratio=o.min_lr_ratio, grad_clip=o.grad_clip,
                                accumulation_steps=o.accumulation_steps),
            micro_batch_size=o.micro_batch_size, seed=o.seed,
            manifest=_absolute(self.data.manifest) if self.data.manifest else None,
            endpoint_url=self.data.endpoint_url, max_length=self.data.max_length,
            world_size=t.world_size, log_every=t.log_every, checkpoint_every=t.checkpoint_every,
            keep_last=t.keep_last, config=self.model_dump(mode="json"), live_eval=self.live_eval.settings(),
            device_field=device_field,
            tracking=self.tracking if self.tracking.enabled else None,
        )


# -- specray pipeline run ---------------------------------------------------------------------


class RaySection(Section):
    address: str | None = Field(
        None, description="Ray cluster to join (e.g. ray://host:10001 or auto); None = the job's cluster under "
                          "`ray job submit` (RAY_ADDRESS), else a new local cluster on 127.0.0.1",
    )
    num_cpus: int | None = Field(None, gt=0, description="logical CPUs of a new local cluster (None = the machine's cores)")


class PipelineTrainSection(Section):
    drafter: DrafterSection = _drafter_field()
    objective: SerializeAsAny[BaseModel] = _objective_field()
    optim: OptimSection = OptimSection()
    num_workers: int = Field(1, gt=0, description="trainer gang size (Ray Train workers = DP ranks)")
    cpus_per_worker: float = Field(1.0, gt=0, description="logical CPUs per worker (Ray sets its torch threads to match)")
    gpus_per_worker: int = Field(0, ge=0, description="GPUs Ray grants each worker (> 0: Ray Train with use_gpu, NCCL; "
                                                      "0: CPU workers, gloo)")
    device: Literal["auto", "cpu", "cuda"] = _device_field()
    precision: Literal["auto", "fp32", "bf16"] = _precision_field()
    max_failures: int = Field(1, ge=0, description="worker-group restarts from the last checkpoint before the run fails")
    log_every: int = Field(10, gt=0)
    checkpoint_every: int = Field(50, gt=0)
    storage: str | None = Field(None, description="Ray Train checkpoint storage: a path or s3://… (None = <run_dir>/ray-train)")
    live_eval: LiveEvalSection = _live_eval_field()
    tracking: TrackingSettings = _tracking_field()

    _drafter = field_validator("drafter", mode="before")(classmethod(_drafter_section))
    _objective = field_validator("objective", mode="before")(classmethod(_objective_section))


class OnlineSection(Section):
    max_inflight_samples: int = Field(
        64, gt=0, description="features stored but not yet deleted, at most (>= Q x train.checkpoint_every)",
    )
    max_inflight_bytes: int | None = Field(None, gt=0, description="the same bound in bytes (None = no byte bound)")
    ledger: str | None = Field(
        None, description="ack ledger location, outside the feature store (None = next to the checkpoints in train.storage)",
    )


class RegenerateSection(Section):
    """The target answers the training prompts itself before capture (``specray regenerate``)."""

    enabled: bool = Field(False, description="answer data.dataset's prompts with the target first; capture reads the "
                                             "answers (<run_dir>/regenerate/answers.jsonl) instead of the dataset's")
    batch_size: int = Field(16, gt=0, description="conversations answered at once per actor (continuous batching)")
    max_tokens: int = Field(1024, gt=0, description="tokens per answer; a longer answer is cut and marked "
                                                    "finish_reason=length")
    max_prompt_tokens: int = Field(1024, gt=0, description="a turn whose context (earlier turns included) is longer "
                                                           "ends its conversation before it")
    max_turns: int = Field(4, gt=0, description="user turns answered per conversation (multi-turn conversations keep "
                                                "the target's own earlier answers in context)")
    temperature: float = Field(0.0, ge=0, description="0 = greedy: the answers greedy serving gives")
    seed: int | None = None
    exclude: list[str] = Field(["mtbench", "humaneval"],
                               description="eval datasets whose prompts are kept out (a conversation sharing a "
                                           "13-word run with any of their prompts is dropped)")
    mix: dict[Literal["chat", "code", "reasoning"], float] | None = Field(
        None, description="shares of prompt kinds to take, e.g. {chat: 0.5, code: 0.3, reasoning: 0.2} (None = the "
                          "dataset's own order and mix)")

    @field_validator("exclude")
    @classmethod
    def _eval_sets(cls, value: list[str]) -> list[str]:
        evals = sorted(k for k, spec in DATASETS.items() if spec.split == "eval")
        for name in value:
            if name not in evals:
                raise ValueError(f"{name!r} is not an eval dataset; exclude lists some of {evals}")
        return value

    @field_validator("mix")
    @classmethod
    def _shares(cls, value: dict | None) -> dict | None:
        if value is not None:
            if any(v < 0 for v in value.values()) or abs(sum(value.values()) - 1) > 1e-6:
                raise ValueError(f"the shares must be >= 0 and sum to 1, got {value}")
        return value


class PipelineBenchSection(Section):
    enabled: bool = Field(True, description="measure tau and speed of the exported drafter vs our AR")
    dataset: Literal["mtbench", "humaneval"] = Field("mtbench", description="held-out prompts")
    num_prompts: int = Field(8, gt=0)
    max_tokens: int = Field(64, gt=0)
    batch_sizes: list[int] = Field([1], min_length=1, description="batch sizes to measure (1 gives speedup_vs_ar)")


# -- specray serve ----------------------------------------------------------------------------


class ServeEngineSection(Section):
    max_batch: int = Field(4, gt=0, description="requests decoded at once per replica (KV slots); more wait in its queue")
    max_len: int = Field(2048, gt=0, description="KV capacity per request: prompt + max_tokens + one verify block")
    drafter: str | None = Field(
        None, description="an export dir to start with (None = autoregressive until the registry has a version)",
    )
    num_threads: int | None = Field(None, gt=0, description="torch intra-op threads per replica (None = torch's default)")
    num_speculative_tokens: int | None = Field(
        None, gt=0, description="the largest round: drafts verified (a chain) or tree depth (None = the worker's "
                                "default, e.g. DFlash's block size - 1)")
    speculation: Literal["auto", "static"] = Field(
        "auto", description="auto: each round's size from the cost table and the drafter's measured acceptance, a "
                            "plain step when no round pays; static: always the largest round")
    max_speculative_batch: int | None = Field(
        None, ge=0, description="an upper bound: a batch of more requests takes plain steps, one target row each "
                                "(None = no bound; the chooser decides)")
    tree: bool = Field(False, description="draft trees (EAGLE-2 dynamic trees; EAGLE-3 drafters)")
    cost_table: str | None = Field(
        None, description="a cost table from `specray profile` on this machine (None = each replica measures one "
                          "when its first drafter loads)")


class VllmSection(Section):
    """vLLM's engine arguments for ``backend: vllm`` (serving/vllm_engine.py), passed to its
    ``EngineArgs`` as named. specray sets the rest itself: the model (the target), the tokenizer,
    ``speculative_config`` (the registry version's speculators export and
    ``engine.num_speculative_tokens``), ``max_num_seqs`` (``engine.max_batch``) and, unless given
    here, ``max_model_len`` (``engine.max_len``)."""

    tensor_parallel_size: int = Field(1, ge=1, description="GPUs the target's layers are split across (one node)")
    pipeline_parallel_size: int = Field(1, ge=1, description="pipeline stages the target is split into (one node)")
    max_model_len: int | None = Field(None, gt=0, description="context length (None = engine.max_len)")
    gpu_memory_utilization: float = Field(0.9, gt=0, le=1, description="fraction of each GPU vLLM may use")
    max_num_batched_tokens: int | None = Field(None, gt=0, description="tokens per engine step (None = vLLM's default)")
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field(
        "auto", description="the target's compute dtype (auto = the checkpoint's, float32 on CPU)")
    kv_cache_dtype: Literal["auto", "fp8", "fp8_e4m3", "fp8_e5m2", "bfloat16"] = Field("auto")
    enforce_eager: bool = Field(False, description="no CUDA graphs (slower; less memory, faster start)")
    enable_prefix_caching: bool | None = Field(None, description="None = vLLM's default")
    quantization: str | None = Field(None, description="a vLLM quantization method for the target (None = none)")
    kv_cache_memory_gib: float | None = Field(
        None, gt=0, description="KV cache size per replica (CPU: VLLM_CPU_KVCACHE_SPACE, default what engine.max_batch "
                                "requests of engine.max_len tokens need; GPU: kv_cache_memory_bytes, default "
                                "vLLM's)")
    seed: int = Field(0, ge=0, description="vLLM's seed for requests that give none")

    @property
    def gpus(self) -> int:
        """GPUs one engine spans."""
        return self.tensor_parallel_size * self.pipeline_parallel_size


BACKENDS = ("specray", "vllm")


class ServeBackendFields(BaseModel):
    """What the serving backend and its GPUs are: shared by ``specray serve``'s config (top level)
    and the pipeline's ``serve`` section."""

    backend: Literal["specray", "vllm"] = Field(
        "specray", description="specray: our engine (CPU-first, every algorithm's worker, chooser, trees); vllm: a "
                               "vLLM engine per replica serving the registry version's speculators export")
    vllm: VllmSection = Field(default_factory=VllmSection, description="vLLM engine arguments (backend vllm)")
    num_gpus_per_replica: float = Field(
        0.0, ge=0, description="GPUs Ray grants each replica (backend vllm: tensor_parallel_size x "
                               "pipeline_parallel_size whole GPUs, or 0 for vLLM-CPU)")

    def check_backend(self, prefix: str, engine: ServeEngineSection) -> None:
        """Refuse what the backend does not do, naming the field (``prefix`` is ``serve.`` in a pipeline)."""
        if self.backend == "specray":
            changed = sorted(self.vllm.model_dump(exclude_defaults=True))
            if changed:
                raise ValueError(f"{prefix}vllm.{changed[0]} is a vLLM engine argument, "
                                 f"but {prefix}backend=specray: set {prefix}backend=vllm or remove {prefix}vllm")
            return
        refused = [("tree", engine.tree, "vLLM verifies chains: set engine.tree=false"),
                   ("cost_table", engine.cost_table is not None, "vLLM has no chooser to read it: remove it"),
                   ("max_speculative_batch", engine.max_speculative_batch is not None,
                    "vLLM drafts for every batch: remove it"),
                   ("num_threads", engine.num_threads is not None,
                    "vLLM-CPU sets its own threads (VLLM_CPU_OMP_THREADS_BIND): remove it")]
        for name, bad, fix in refused:
            if bad:
                raise ValueError(f"{prefix}engine.{name} does not apply to {prefix}backend=vllm; {fix.replace('engine.', prefix + 'engine.')}")
        gpus = self.num_gpus_per_replica
        if gpus and gpus != self.vllm.gpus:
            raise ValueError(
                f"{prefix}num_gpus_per_replica={gpus:g}, but one vLLM engine spans {prefix}vllm.tensor_parallel_size "
                f"x pipeline_parallel_size = {self.vllm.gpus} GPUs: set {prefix}num_gpus_per_replica={self.vllm.gpus} "
                f"(or 0 for vLLM-CPU)")
        if not gpus and self.vllm.gpus > 1:
            raise ValueError(f"{prefix}vllm.tensor_parallel_size x pipeline_parallel_size = {self.vllm.gpus} needs "
                             f"GPUs: set {prefix}num_gpus_per_replica={self.vllm.gpus}")


class RegistrySection(Section):
    uri: str | None = Field(
        None, description="DrafterRegistry root: a path, file://… or s3://bucket/prefix (None = no hot-load)",
    )
    endpoint_url: str | None = Field(None, description="S3 endpoint for an s3:// registry (else $SPECRAY_S3_ENDPOINT)")
    poll_interval_s: float = Field(10.0, gt=0, description="seconds between a replica's checks for a newer version")
    cache_dir: str | None = Field(None, description="where replicas pull versions to (None = <run_dir>/drafter-cache)")

    @field_validator("uri")
    @classmethod
    def _known_scheme(cls, value: str | None) -> str | None:
        if value is not None and "://" in value and not value.startswith(("file://", "s3://")):
            raise ValueError(f"registry URI {value!r}: use a path, file://PATH or s3://BUCKET/PREFIX")
        return value


class AutoscalingSection(Section):
    min_replicas: int = Field(1, ge=1, description="replicas kept running even when idle")
    max_replicas: int = Field(1, ge=1, validate_default=True, description="replicas at most under load")
    target_ongoing_requests: float = Field(
        2.0, gt=0, description="in-flight requests per replica the autoscaler aims for (add replicas above it)",
    )
    upscale_delay_s: float = Field(10.0, ge=0, description="load must stay high this long before a replica is added")
    downscale_delay_s: float = Field(120.0, ge=0, description="load must stay low this long before a replica is removed")

    @field_validator("max_replicas")
    @classmethod
    def _at_least_min(cls, value: int, info) -> int:
        low = info.data.get("min_replicas")
        if low is not None and value < low:
            raise ValueError(f"max_replicas must be >= min_replicas ({low}); raise max_replicas or lower min_replicas")
        return value


class ReplicaSection(Section):
    num_cpus: float = Field(1.0, gt=0, description="logical CPUs Ray reserves per replica")
    max_ongoing_requests: int = Field(16, gt=0, description="requests Serve routes to one replica at once")


class HttpSection(Section):
    host: str = Field("127.0.0.1", description="address the HTTP proxy binds; anything but loopback needs an api_key")
    port: int = Field(8000, ge=1, le=65535, description="HTTP port of the proxy")
    api_key: str | None = Field(
        None, description="require 'Authorization: Bearer KEY' (None = $SPECRAY_API_KEY if set, else no key)",
    )
    limits: HttpLimits = Field(
        default_factory=HttpLimits, description="per-request bounds checked before any tokenizing: max_body_bytes "
                                                "(larger bodies are a 413), max_prompt_bytes, docs (/docs, /redoc, "
                                                "/openapi.json served without a key)",
    )


def _record_field() -> Any:
    return Field(default_factory=RecordSettings,
                 description="record served traffic (users' prompts and answers) as JSONL shards: uri (None = off), "
                             "endpoint_url, sample_rate, records_per_shard, flush_interval_s, max_queue "
                             "(serving/recorder.py)")


class ServeOutputSection(Section):
    run_dir: str | None = Field(None, description="pulled drafter versions go under it (None = runs/<name>)")


class ServeJobConfig(JobConfig, ServeBackendFields):
    """``specray serve``: OpenAI-compatible Ray Serve replicas that hot-load drafters from a registry."""

    name: RunName = Field("serve", description="Ray Serve application name; the default run dir is runs/<name>")
    model_name: str | None = Field(None, description="the model id clients send (None = the target's name)")
    target: TargetConfig = TargetConfig()
    engine: ServeEngineSection = ServeEngineSection()
    registry: RegistrySection = RegistrySection()
    autoscaling: AutoscalingSection = AutoscalingSection()
    replica: ReplicaSection = ReplicaSection()
    http: HttpSection = HttpSection()
    record: RecordSettings = _record_field()
    ray: RaySection = RaySection()
    output: ServeOutputSection = ServeOutputSection()
    # the chat format the served drafters were captured with (their capture's data.chat_template / _kwargs)
    chat_template: str | None = _chat_template_field()
    chat_template_kwargs: dict[str, Any] = _chat_template_kwargs_field()

    _known_template = field_validator("chat_template")(classmethod(lambda cls, value: check_chat_template(value)))
    _template_values = field_validator("chat_template_kwargs")(classmethod(lambda cls, value: check_template_kwargs(value)))

    @model_validator(mode="after")
    def _backend_applies(self) -> "ServeJobConfig":
        self.check_backend("", self.engine)
        return self

    @property
    def served_model_name(self) -> str:
        return self.model_name or Path(self.target.name.removeprefix("embedded:")).name


# -- specray pipeline run (the whole config) ---------------------------------------------------


class PipelineCaptureSection(CaptureConfig):
    num_actors: int = Field(1, gt=0, description="CaptureServer actors, each loading the target once")
    num_cpus_per_actor: float = Field(1.0, gt=0, description="logical CPUs Ray reserves per capture actor")
    num_gpus_per_actor: float = Field(
        0.0, ge=0, description="GPUs Ray grants each capture actor (a fraction shares one GPU; a whole number > 1 "
                               "places the target across that many GPUs of one node with device_map=auto)")

    @field_validator("num_gpus_per_actor")
    @classmethod
    def _whole_above_one(cls, value: float) -> float:
        if value > 1 and value != int(value):
            raise ValueError(f"num_gpus_per_actor={value}: above 1 an actor spreads the target over whole GPUs; use a "
                             f"whole number ({int(value)} or {int(value) + 1}) or a fraction <= 1")
        return value


class PipelineServeSection(Section, ServeBackendFields):
    enabled: bool = Field(True, description="publish the export and serve it through Ray Serve (OpenAI API)")
    keep_running: bool = Field(False, description="keep serving after the report until Ctrl-C (False = stop the app)")
    registry: str | None = Field(None, description="drafter registry: a path or s3://… (None = <run_dir>/registry)")
    smoke_requests: int = Field(4, ge=1, description="completions + chat requests sent through the openai client")
    engine: ServeEngineSection = ServeEngineSection()
    autoscaling: AutoscalingSection = AutoscalingSection()
    replica: ReplicaSection = ReplicaSection()
    http: HttpSection = HttpSection()
    record: RecordSettings = _record_field()

    @model_validator(mode="after")
    def _backend_applies(self) -> "PipelineServeSection":
        self.check_backend("serve.", self.engine)
        return self


class ClosedLoopLoadSection(Section):
    dataset: Literal["mtbench", "humaneval"] = Field("humaneval", description="prompts the load generator sends, "
                                                                                "in order, each once per pass")
    num_prompts: int | None = Field(None, gt=0, description="use the first N prompts (None = all of them)")
    clients: int = Field(2, gt=0, description="concurrent `openai` clients streaming greedy chat completions")
    max_tokens: int = Field(64, gt=0, description="tokens per answer at most")
    request_timeout_s: float = Field(300.0, gt=0, description="a request taking longer fails (and is counted)")
    pause_s: float = Field(0.0, ge=0, description="each client waits this long between requests (0 = back to back)")


class ClosedLoopSection(Section):
    iterations: int = Field(2, gt=0, description="loop iterations: each trains, publishes and hot-loads one version")
    time_budget_s: float | None = Field(None, gt=0, description="start no iteration after this many seconds of "
                                                                "the loop (None = run every iteration)")
    records_per_iteration: int = Field(
        16, gt=0, description="an iteration starts once shards no iteration took hold this many chat records, and "
                              "takes the oldest whole shards that hold at least this many (the rest wait for the next "
                              "iteration); the newest version serves this many requests before the loop ends")
    records_timeout_s: float = Field(1800.0, gt=0, description="waiting longer for records fails the run")
    hot_load_timeout_s: float = Field(600.0, gt=0, description="every replica must serve a new version within this")
    load: ClosedLoopLoadSection = Field(default_factory=ClosedLoopLoadSection,
                                        description="the traffic: a load generator of `openai` clients")


class PipelineOutputSection(Section):
    run_dir: str | None = Field(None, description="everything the run writes, report.json included (None = runs/<name>)")


class PipelineConfig(JobConfig):
    """``specray pipeline run``: capture → train → export → serve → bench on Ray, one report."""

    name: RunName = Field("pipeline", description="run name; the default run dir is runs/<name>")
    mode: Literal["offline", "online", "closed_loop"] = Field(
        "offline", description="offline: capture everything, then train on the manifest; online: capture actors "
                               "and the trainer gang run at once, consume-once, bounded store; closed_loop: serve, "
                               "record the traffic and retrain on it online, version after version "
                               "(pipeline/jobs/closed_loop.py)",
    )
    ray: RaySection = RaySection()
    target: TargetConfig = TargetConfig()
    data: DataConfig = DataConfig()
    capture: PipelineCaptureSection = PipelineCaptureSection()
    store: StoreConfig = StoreConfig()
    train: PipelineTrainSection = PipelineTrainSection()
    online: OnlineSection = OnlineSection()
    serve: PipelineServeSection = PipelineServeSection()
    bench: PipelineBenchSection = PipelineBenchSection()
    regenerate: RegenerateSection = Field(default_factory=RegenerateSection,
                                          description="self-distillation before capture: the target's own answers")
    closed_loop: ClosedLoopSection = Field(default_factory=ClosedLoopSection,
                                           description="mode=closed_loop: iterations, records per iteration, the load")
    output: PipelineOutputSection = PipelineOutputSection()

    @model_validator(mode="after")
    def _name_leaves_room_for_sub_runs(self) -> "PipelineConfig":
        suffix = SUB_RUN_SUFFIX[self.mode]
        if len(self.name) + len(suffix) > MAX_NAME:
            raise ValueError(f"name: with mode={self.mode} the run name has at most {MAX_NAME - len(suffix)} "
                             f"characters (got {len(self.name)}): its sub-runs append up to {len(suffix)} "
                             f"(<name>{suffix}); shorten it")
        return self

    @model_validator(mode="after")
    def _online_bound_holds_a_window(self) -> "PipelineConfig":
        check_capture_fits(self.train.drafter.algorithm, self.capture.algorithm, field="train.drafter.algorithm")
        o, t = self.online, self.train
        window = t.num_workers * t.optim.micro_batch_size * t.optim.accumulation_steps
        need = window * t.checkpoint_every  # features are deleted only once a checkpoint covers them
        if self.mode != "offline" and o.max_inflight_samples < need:  # closed_loop iterations train online
            raise ValueError(
                f"online.max_inflight_samples={o.max_inflight_samples} cannot hold one checkpoint interval: "
                f"Q = train.num_workers x train.optim.micro_batch_size x train.optim.accumulation_steps = {window} "
                f"samples per step x train.checkpoint_every={t.checkpoint_every} = {need} (features are deleted only "
                f"after a checkpoint covers them); raise online.max_inflight_samples to >= {need} or lower "
                f"train.checkpoint_every"
            )
        if self.mode == "offline" and (self.store.uri or "").startswith("ray://"):
            raise ValueError(
                f"store.uri={self.store.uri} is the Ray object store, a cache that dies with the capture actors; "
                "offline mode writes a manifest that training reads later: use a file:// or s3:// store.uri, "
                "or mode=online"
            )
        d = self.train.drafter
        if self.mode == "online" and d.draft_vocab_size is not None and not d.init_from and not d.draft_vocab_from:
            raise ValueError(
                f"train.drafter.draft_vocab_size={d.draft_vocab_size} is counted from a finished capture's manifest, "
                "and online training streams features that do not exist yet: set train.drafter.draft_vocab_from=<a "
                "manifest, or a dataset: sharegpt, jsonl:PATH, records:URI> to count it from, use mode=offline, set "
                "train.drafter.init_from=<an export with a draft vocabulary>, or train.drafter.draft_vocab_size=null"
            )
        if self.mode != "offline" and self.capture.max_batch_size > o.max_inflight_samples:
            raise ValueError(
                f"capture.max_batch_size={self.capture.max_batch_size} exceeds online.max_inflight_samples="
                f"{o.max_inflight_samples}: a capture batch reserves room for all its samples before it runs; "
                f"lower capture.max_batch_size"
            )
        return self

    @model_validator(mode="after")
    def _devices_have_their_ray_resources(self) -> "PipelineConfig":
        check_ray_devices(self.target.device, self.capture.num_gpus_per_actor, device_field="target.device",
                          gpus_field="capture.num_gpus_per_actor", who="capture actors")
        check_ray_devices(self.train.device, self.train.gpus_per_worker, device_field="train.device",
                          gpus_field="train.gpus_per_worker", who="trainer gang workers")
        return self

    @model_validator(mode="after")
    def _closed_loop_serves_fixed_replicas(self) -> "PipelineConfig":
        if self.mode != "closed_loop":
            return self
        if not self.serve.enabled:
            raise ValueError("mode=closed_loop serves the traffic it trains on: set serve.enabled=true")
        a = self.serve.autoscaling
        if a.min_replicas != a.max_replicas:
            raise ValueError(f"mode=closed_loop waits for every replica to hot-load each version: set "
                             f"serve.autoscaling.max_replicas={a.min_replicas} (= min_replicas; got {a.max_replicas})")
        return self

    @model_validator(mode="after")
    def _regenerate_has_a_size(self) -> "PipelineConfig":
        if self.regenerate.enabled:
            if self.mode != "offline":
                raise ValueError(f"regenerate.enabled runs before an offline capture; with mode={self.mode} set "
                                 "regenerate.enabled=false and regenerate first (specray regenerate), or mode=offline")
            if self.data.max_samples is None:
                raise ValueError("regenerate.enabled answers data.max_samples conversations: set data.max_samples "
                                 "(e.g. 2000)")
            if self.data.dataset.startswith("records:"):
                raise ValueError("regenerate.enabled answers prompts again; records: holds served answers already: "
                                 "set regenerate.enabled=false")
        return self

    @property
    def store_uri(self) -> str:
        return self.store.uri or (self.run_dir / "features").resolve().as_uri()

    @property
    def regenerated(self) -> Path:
        """Where the regenerate stage writes the answers capture reads."""
        return (self.run_dir / "regenerate" / "answers.jsonl").resolve()

    def capture_data(self) -> DataConfig:
        """What capture reads: the regenerated answers when regenerate.enabled, else data as given."""
        if not self.regenerate.enabled:
            return self.data
        return self.data.model_copy(update={"dataset": f"jsonl:{self.regenerated}", "skip": 0, "max_samples": None,
                                            "id_field": None})

    def capture_job(self) -> CaptureJobConfig:
        capture = self.capture.model_dump(exclude={"num_actors", "num_cpus_per_actor", "num_gpus_per_actor"})
        return CaptureJobConfig(
            name=f"{self.name}-capture", target=self.target, data=self.capture_data(), capture=CaptureConfig(**capture),
            store=StoreConfig(uri=self.store_uri, endpoint_url=self.store.endpoint_url),
            output=OutputConfig(run_dir=str(self.run_dir / "capture"), overwrite=True),
        )

    def train_job(self, manifest: str | None) -> TrainJobConfig:
        t = self.train
        return TrainJobConfig(
            name=f"{self.name}-train", target=self.target,
            data=TrainDataConfig(manifest=manifest, endpoint_url=self.store.endpoint_url),
            drafter=t.drafter, objective=t.objective, optim=t.optim,
            trainer=TrainerSection(world_size=t.num_workers, log_every=t.log_every, checkpoint_every=t.checkpoint_every,
                                   device=t.device, precision=t.precision),
            live_eval=t.live_eval, tracking=t.tracking,
            output=TrainOutputSection(run_dir=str(self.run_dir / "train")),
        )

    def serve_job(self) -> ServeJobConfig:
        s = self.serve
        return ServeJobConfig(
            name=self.name, target=self.target, engine=s.engine, backend=s.backend, vllm=s.vllm,
            num_gpus_per_replica=s.num_gpus_per_replica,
            registry=RegistrySection(uri=self.registry_uri, endpoint_url=self.store.endpoint_url, poll_interval_s=1.0),
            autoscaling=s.autoscaling, replica=s.replica, http=s.http, ray=self.ray,
            record=s.record.model_copy(update={"endpoint_url": s.record.endpoint_url or self.store.endpoint_url}),
            output=ServeOutputSection(run_dir=str(self.run_dir / "serve")),
            chat_template=self.data.chat_template, chat_template_kwargs=self.data.chat_template_kwargs,
        )

    @property
    def registry_uri(self) -> str:
        return self.serve.registry or str((self.run_dir / "registry").resolve())
