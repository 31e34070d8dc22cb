"""A C4-like TFDS dataset of the synthetic generator in array_record files (offline tests
and benchmarks), built as a real copy is: by a builder in a subprocess, so the caller
reads it from files only, with no builder class registered."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

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
            join = int(sys.argv[4])  # generated documents per record (C4's are ~4x longer)
            docs = generate_documents(n * join, seed=11, split=split)
            for i in range(n):
                t = chr(10).join(docs[i * join:(i + 1) * join])
                yield f"{split}-{i}", {"text": t, "url": f"http://example.com/{split}/{i}"}

    HldTinyC4(config="en", data_dir=sys.argv[1], file_format="array_record").download_and_prepare()
''')


def build_tfds(d: str | Path, train_docs: int = 120, valid_docs: int = 12, join: int = 1
               ) -> Path:
    """Builds `NAME` under the TFDS data_dir `d` (`join` generated documents per record);
    returns `d`."""
    d = Path(d)
    # Built in a subprocess, so this process reads it like a real C4 copy: from
    # files only, with no builder class registered.
    d.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "TFDS_DATA_DIR": str(d)}
    out = subprocess.run([sys.executable, "-c", BUILD_TFDS, str(d), str(train_docs),
                          str(valid_docs), str(join)], env=env, capture_output=True, text=True)
    if out.returncode or not list(d.glob("hld_tiny_c4/en/1.0.0/*.array_record*")):
        raise RuntimeError(f"building the TFDS corpus failed: {out.stderr[-2000:]}")
    return d


