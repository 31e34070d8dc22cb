"""The real-text study's student: a 6-layer text-student on the World English Bible's
training books, distilled from experiments/real_text_teacher.py. The study's phases
(sweeps/real_text.py) set its method, budget and swept values; one run by hand, once
the study's corpus and teacher exist:

    python -m hldstudy.train --config real_text_student --method kd --set data.path=DIR/shards --set teacher.checkpoint=DIR/teacher --workdir DIR/kd
"""

from hldstudy.config import Config, DataConfig, DistillConfig, TrainConfig
from hldstudy.distill import methods
from hldstudy.model.presets import preset


def get_config() -> Config:
    return Config(
        name="real-text-student",
        model=preset("text-student"),
        data=DataConfig(source="shards", seq_len=128, batch_size=16, tokenizer_vocab_size=4096),
        train=TrainConfig(steps=500, lr=3e-3, warmup_steps=25, log_every=25,
                          checkpoint_every=125, eval_batches=0),  # 0: the whole validation split
        distill=DistillConfig(method=methods.REFERENCE, alpha=0.5, temperature=1.0,
                              hidden_weight=1.0),
    )
