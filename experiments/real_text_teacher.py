"""The real-text study's teacher: an 8-layer text-teacher pretrained on the World English
Bible's training books (hldstudy.study.corpus), several epochs. `hldstudy study real-text`
trains it; by hand, once the corpus is prepared:

    python -m hldstudy.train --config real_text_teacher --set data.path=DIR/shards --workdir DIR/teacher
"""

from hldstudy.config import Config, DataConfig, TrainConfig
from hldstudy.model.presets import preset


def get_config() -> Config:
    return Config(
        name="real-text-teacher",
        model=preset("text-teacher"),
        data=DataConfig(source="shards", seq_len=128, batch_size=16, tokenizer_vocab_size=4096),
        train=TrainConfig(steps=2000, lr=3e-3, warmup_steps=100, log_every=50,
                          checkpoint_every=250, eval_batches=0),  # 0: the whole validation split
    )
