"""CPU-scale Qwen3.5 distillation: the tiny-qwen student (4 layers, 3:1 Gated DeltaNet /
gated attention, SwiGLU, untied head) distilled from the tiny MoE teacher of
experiments/tiny_qwen_teacher.py; the two share the synthetic corpus's 512-token vocabulary.

    python -m hldstudy.train --config tiny_qwen_distill --method kd \
        --set teacher.checkpoint=runs/qwen-teacher --workdir runs/qwen-kd

FLOPs per step without a teacher run (the preset gives the teacher's shape):

    hldstudy flops --config tiny_qwen_distill --teacher-preset tiny-qwen-moe
"""

from hldstudy.config import Config, DataConfig, DistillConfig, TrainConfig
from hldstudy.distill import methods
from hldstudy.model.presets import preset


def get_config() -> Config:
    return Config(
        name="tiny-qwen-distill",
        model=preset("tiny-qwen"),
        data=DataConfig(source="synthetic", seq_len=128, batch_size=8, tokenizer_vocab_size=512,
                        synthetic_docs=4000, synthetic_valid_docs=200),
        train=TrainConfig(steps=100, lr=3e-3, warmup_steps=10, log_every=10,
                          checkpoint_every=50, eval_batches=4),
        distill=DistillConfig(method=methods.REFERENCE, alpha=0.5, temperature=1.0,
                              hidden_weight=1.0),
    )
