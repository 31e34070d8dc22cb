"""The quickstart teacher: a 6-layer tiny-teacher pretrained on the synthetic corpus.

    python -m hldstudy.train --config tiny_teacher --workdir runs/teacher
"""

from hldstudy.config import Config, DataConfig, TrainConfig
from hldstudy.model.presets import preset


def get_config() -> Config:
    return Config(
        name="tiny-teacher",
        model=preset("tiny-teacher"),
        data=DataConfig(source="synthetic", seq_len=128, batch_size=16, tokenizer_vocab_size=512,
                        synthetic_docs=4000, synthetic_valid_docs=200),
        train=TrainConfig(steps=200, lr=3e-3, warmup_steps=20, log_every=20,
                          checkpoint_every=100, eval_batches=4),
    )
