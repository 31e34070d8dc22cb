"""A tiny C4-like TFDS dataset in array_record files (by default 120 train, 12 validation
documents of the synthetic generator, seed 11), built as a real copy is: by a builder in a
subprocess, so the tests read it from files only, with no builder class registered."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
NAME = "hld_tiny_c4/en"

BUILD_TFDS = textwrap.dedent('''
    import sys, tensorflow_datasets as tfds
    from hldstudy.data.synthetic import generate_documents

    class HldTinyC4(tfds.core.GeneratorBasedBuilder):
        VERSION = tfds.core.Version("1.0.0")
        BUILDER_CONFIGS = [tfds.core.BuilderConfig(name="en")]

        def _info(self):
            return tfds.core.DatasetInfo(builder=self, features=tfds.features.FeaturesDict(
                {"text": tfds.features.Text(), "url": tfds.features.Text()}))

        def _split_generators(self, dl_manager):
            return {"train": self._generate_examples("train", int(sys.argv[2])),
                    "validation": self._generate_examples("validation", int(sys.argv[3]))}

        def _generate_examples(self, split, n):
            for i, t in enumerate(generate_documents(n, seed=11, split=split)):
                yield f"{split}-{i}", {"text": t, "url": f"http://example.com/{split}/{i}"}

    HldTinyC4(config="en", data_dir=sys.argv[1], file_format="array_record").download_and_prepare()
''')


def build_tfds(d: Path, train_docs: int = 120, valid_docs: int = 12) -> Path:
    """Builds the dataset under the TFDS data_dir `d`; returns `d`."""
    # Built in a subprocess, so this process reads it like a real C4 copy: from
    # files only, with no builder class registered.
    d.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "TFDS_DATA_DIR": str(d)}
    subprocess.run([sys.executable, "-c", BUILD_TFDS, str(d), str(train_docs), str(valid_docs)],
                   check=True, env=env,
                   capture_output=True, cwd=ROOT)
    assert list(d.glob("hld_tiny_c4/en/1.0.0/*.array_record*"))
    return d


