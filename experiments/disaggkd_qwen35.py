"""The disaggregated-teacher experiment at its real shapes: Qwen3.5-35B-A3B (hybrid
Gated DeltaNet / gated attention, 256 experts with 8 routed + 1 shared per token, 248,320
vocabulary) served by teacher replicas, distilled with logit KD into a Qwen3.5-9B student
(32 layers, d 4096, untied head) on a cluster. The student is trained from its random
initialisation here; the teacher is an imported HF checkpoint (Qwen3_5MoeForCausalLM or the
multimodal checkpoint's language model) whose tokenizer.json the student's data uses.

    python -m hldstudy.train --config experiments/disaggkd_qwen35.py --set data.path=/data/tensorflow_datasets --set data.tokenizer=/ckpt/Qwen3.5-35B-A3B/tokenizer.json --set teacher.checkpoint=remote://teacher-0:7000,teacher-1:7000

The teacher replicas serve the imported checkpoint (python -m hldstudy.teacher, one per
host). Without weights or data (nothing reads data.path, data.tokenizer or the teacher
here; the teacher's shape comes from its preset, teacher.preset):

    python -m hldstudy.sweep experiments/disaggkd_qwen35.py --dry-run
    hldstudy flops --config experiments/disaggkd_qwen35.py --layout disaggregated
    hldstudy plan --config experiments/disaggkd_qwen35.py --target h200:8
    hldstudy plan --sweep experiments/disaggkd_qwen35.py --devices 64 --hbm 141
"""

from hldstudy.config import (
    BudgetConfig,
    Config,
    DataConfig,
    DistillConfig,
    TeacherConfig,
    TrainConfig,
)
from hldstudy.model.presets import preset
from hldstudy.sweep import Sweep

TEACHER_PRESET = "qwen3.5-35b-a3b"
STUDENT_PRESET = "qwen3.5-9b"
SEQ_LEN = 4096
BATCH_SIZE = 256  # sequences per step: 1,048,576 tokens
STEPS = 10_000  # ~10.5B tokens


def get_config() -> Config:
    return Config(
        name="disaggkd-qwen3.5-35b-a3b-to-9b",
        # Scanned in groups of its pattern (three DeltaNet layers, one attention layer):
        # compile time and the backward's live buffers bounded by one group.
        # Attention by the target's fused kernel (splash on TPU, cuDNN on GPU): a dense
        # layer holds its 4096 x 4096 scores per head.
        model=preset(STUDENT_PRESET, dtype="bfloat16", remat=True, scan_layers=True,
                     attention="auto"),
        data=DataConfig(source="tfds", tfds_name="c4/en", seq_len=SEQ_LEN,
                        batch_size=BATCH_SIZE, add_bos=False),
        train=TrainConfig(steps=STEPS, lr=3e-4, warmup_steps=500, schedule="cosine",
                          min_lr_ratio=0.1, weight_decay=0.1, log_every=50, eval_every=1000,
                          eval_batches=32, checkpoint_every=500, keep_checkpoints=2,
                          # The 9B student's state (float32 weights, Adam: ~144 GiB) sharded
                          # over every device of the student's mesh (FSDP), however many.
                          mesh_data=1, mesh_fsdp=-1),
        distill=DistillConfig(method="kd", alpha=0.5, temperature=1.0, loss_impl="fused",
                              fused_backend="auto"),
        # The replicas serve the teacher in bf16 (a 35B teacher in float32 is ~130 GiB);
        # its shape, until the checkpoint is given, is its preset's.
        # Each replica over every GPU of its host: the 35B weights (~64 GiB in bf16) split
        # over them, and every micro-batch of the step's sequences too.
        teacher=TeacherConfig(preset=TEACHER_PRESET, dtype="bfloat16", attention="auto",
                              replica_devices=0),
        budget=BudgetConfig(count_teacher=False),
    )


def get_sweep() -> Sweep:
    """The run as a one-point sweep, so `python -m hldstudy.sweep ... --dry-run` lists its
    steps and FLOPs before anything is rented (the teacher counted from its preset)."""
    return Sweep(name="disaggkd-qwen3.5", base=get_config(), methods=("kd",),
                 budget_baseline_steps=STEPS, teacher_preset=TEACHER_PRESET)
