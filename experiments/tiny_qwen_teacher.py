"""CPU-scale Qwen3.5 teacher: the tiny-qwen-moe preset (4 layers, 3:1 Gated DeltaNet /
gated attention, 8 routed experts with 2 active + a shared expert, untied head) pretrained
on the synthetic corpus; the MoE half of the tiny Qwen3.5 pair (experiments/tiny_qwen_distill.py
is the student).

    python -m hldstudy.train --config tiny_qwen_teacher --workdir runs/qwen-teacher
"""

from hldstudy.config import Config, DataConfig, TrainConfig
from hldstudy.model.presets import preset


def get_config() -> Config:
    return Config(
        name="tiny-qwen-teacher",
        model=preset("tiny-qwen-moe"),
        data=DataConfig(source="synthetic", seq_len=128, batch_size=16, tokenizer_vocab_size=512,
                        synthetic_docs=4000, synthetic_valid_docs=200),
        train=TrainConfig(steps=200, lr=3e-3, warmup_steps=20, log_every=20,
                          checkpoint_every=100, eval_batches=4),
    )
