"""The smallest CPU config: a 4-layer GQA student with local/global layers on the
synthetic corpus. A few steps run in well under a minute.

    python -m hldstudy.train --config tiny --workdir runs/tiny --set train.steps=20
"""

from hldstudy.config import Config, DataConfig, TrainConfig
from hldstudy.model.presets import preset


def get_config() -> Config:
    return Config(
        name="tiny",
        model=preset("tiny"),
        data=DataConfig(source="synthetic", seq_len=128, batch_size=8, tokenizer_vocab_size=512,
                        synthetic_docs=4000, synthetic_valid_docs=200),
        train=TrainConfig(steps=50, lr=3e-3, warmup_steps=10, log_every=10,
                          checkpoint_every=25, eval_batches=4),
    )
