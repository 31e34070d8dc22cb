"""The decision map's larger pair: Qwen3.5-122B-A10B (48 layers, 256 experts of 1024, 8 routed
+ 1 shared per token) served by teacher replicas, distilled with logit KD into Qwen3.5-35B-A3B
(itself an MoE, trained from its random initialisation), 256 x 4096 tokens per step. The same
recipe as `experiments/disaggkd_qwen35.py` one size up: where the seed says colocated runs out of
memory even with the fused loss and disaggregation is what makes the pair trainable.

    python -m hldstudy.train --config experiments/disaggkd_qwen35_122b.py --set data.path=/data/tensorflow_datasets --set data.tokenizer=/ckpt/Qwen3.5-122B-A10B/tokenizer.json --set teacher.checkpoint=remote://teacher-0:7000,teacher-1:7000

Without weights or data (the teacher's shape comes from its preset, teacher.preset):

    python -m hldstudy.sweep experiments/disaggkd_qwen35_122b.py --dry-run
    python -m hldstudy.aot --config experiments/disaggkd_qwen35_122b.py --target h200:8 --layout disaggregated
    hldstudy plan --decision-map
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

TEACHER_PRESET = "qwen3.5-122b-a10b"
STUDENT_PRESET = "qwen3.5-35b-a3b"
SEQ_LEN = 4096
BATCH_SIZE = 256  # sequences per step: 1,048,576 tokens
STEPS = 10_000


def get_config() -> Config:
    return Config(
        name="disaggkd-qwen3.5-122b-a10b-to-35b-a3b",
        # Scanned in groups of its pattern; the student's experts by capacity where the
        # target's grouped matmul would expand them densely (model.moe_dispatch auto).
        # The target's fused attention (splash on TPU, cuDNN on GPU) on both sides.
        model=preset(STUDENT_PRESET, dtype="bfloat16", remat=True, scan_layers=True,
                     attention="auto"),
        data=DataConfig(source="tfds", tfds_name="c4/en", seq_len=SEQ_LEN,
                        batch_size=BATCH_SIZE, add_bos=False),
        train=TrainConfig(steps=STEPS, lr=3e-4, warmup_steps=500, schedule="cosine",
                          min_lr_ratio=0.1, weight_decay=0.1, log_every=50, eval_every=1000,
                          eval_batches=32, checkpoint_every=500, keep_checkpoints=2,
                          # The 35B student's state (float32 weights, Adam: ~555 GiB) sharded
                          # over every device of the student's mesh.
                          mesh_data=1, mesh_fsdp=-1),
        distill=DistillConfig(method="kd", alpha=0.5, temperature=1.0, loss_impl="fused",
                              fused_backend="auto"),
        # 122B in bf16 is ~227 GiB: each replica over every GPU of its host.
        teacher=TeacherConfig(preset=TEACHER_PRESET, dtype="bfloat16", attention="auto",
                              replica_devices=0),
        budget=BudgetConfig(count_teacher=False),
    )


def get_sweep() -> Sweep:
    return Sweep(name="disaggkd-qwen3.5-122b", base=get_config(), methods=("kd",),
                 budget_baseline_steps=STEPS, teacher_preset=TEACHER_PRESET)
