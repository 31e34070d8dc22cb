"""CPU-scale distillation of the quickstart teacher into the tiny student.

    python -m hldstudy.train --config tiny_distill --method kd \
        --set teacher.checkpoint=runs/teacher --workdir runs/kd

The data section matches tiny_teacher.py, so the student reads the
teacher's tokenizer and the same corpus.
"""

from hldstudy.config import Config, DataConfig, DistillConfig, TrainConfig
from hldstudy.distill import methods
from hldstudy.model.presets import preset


def get_config() -> Config:
    return Config(
        name="tiny-distill",
        model=preset("tiny"),
        data=DataConfig(source="synthetic", seq_len=128, batch_size=8, tokenizer_vocab_size=512,
                        synthetic_docs=4000, synthetic_valid_docs=200),
        train=TrainConfig(steps=100, lr=3e-3, warmup_steps=10, log_every=10,
                          checkpoint_every=50, eval_batches=0),  # 0: the whole validation split
        # logit KD, the reference method (--method picks another)
        distill=DistillConfig(method=methods.REFERENCE, alpha=0.5, temperature=1.0,
                              hidden_weight=1.0),
    )
